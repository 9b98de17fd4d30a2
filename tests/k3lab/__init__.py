"""Tests of k3lab."""
