"""Fixtures shared by several test files."""
