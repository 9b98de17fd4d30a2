"""Tests of app/library."""
