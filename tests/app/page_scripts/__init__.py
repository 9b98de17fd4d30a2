"""Tests of app/page_scripts."""
