"""The package version: pyproject.toml reads it (``dynamic = ["version"]``) and CHANGELOG.md's
latest release heading names it (tests/test_packaging.py checks both)."""

__version__ = "0.3.0"
