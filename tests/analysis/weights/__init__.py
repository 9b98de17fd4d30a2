"""Tests of analysis/weights."""
