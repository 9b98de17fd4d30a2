"""Models larger than memory: placement, streamed execution, expert store."""
