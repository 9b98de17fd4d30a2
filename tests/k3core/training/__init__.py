"""Tests of k3core/training."""
