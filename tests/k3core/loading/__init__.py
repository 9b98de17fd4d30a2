"""Tests of k3core/loading."""
