"""Tests of k3core."""
