"""Loading and saving: checkpoint files (headers first, one tensor at a time), quantised formats, placement,
streamed execution of models larger than memory, the expert store.

Imports the model's wing, never ``k3core.interp``."""
