"""Tests of k3core/interp."""
