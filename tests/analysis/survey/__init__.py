"""Tests of analysis/survey."""
