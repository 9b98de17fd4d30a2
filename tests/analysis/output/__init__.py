"""Tests of analysis/output."""
