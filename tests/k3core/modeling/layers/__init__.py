"""Tests of k3core/modeling/layers."""
