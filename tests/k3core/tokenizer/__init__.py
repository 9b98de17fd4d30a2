"""Tests of k3core/tokenizer."""
