"""Tests of repo."""
