"""Tests of k3core/bigmodel."""
