"""Tests of analysis/metrics."""
