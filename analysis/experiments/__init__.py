"""Experiments on a model: edits, patching, attribution."""
