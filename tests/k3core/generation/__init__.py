"""Tests of k3core/generation."""
