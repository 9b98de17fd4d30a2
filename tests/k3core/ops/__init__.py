"""Tests of k3core/ops."""
