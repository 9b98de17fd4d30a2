"""Tests of analysis/compare."""
