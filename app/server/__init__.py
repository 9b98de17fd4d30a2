"""The server process."""
