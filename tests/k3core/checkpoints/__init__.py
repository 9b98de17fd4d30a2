"""Tests of k3core/checkpoints."""
