"""Tests of analysis/experiments."""
