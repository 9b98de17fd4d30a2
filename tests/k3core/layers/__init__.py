"""Tests of k3core/layers."""
