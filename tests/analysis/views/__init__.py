"""Tests of analysis/views."""
