"""Tests of k3core/data."""
