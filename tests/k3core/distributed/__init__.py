"""Tests of k3core/distributed."""
