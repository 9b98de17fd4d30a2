"""The View type and the catalogue of views."""
