"""Small helpers every subsystem uses."""
