"""Tests of analysis/figures."""
