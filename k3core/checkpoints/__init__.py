"""Checkpoint files: headers first, one tensor at a time."""
