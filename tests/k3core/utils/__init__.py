"""Tests of k3core/utils."""
