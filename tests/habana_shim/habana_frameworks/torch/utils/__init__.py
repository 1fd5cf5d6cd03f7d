"""Test-only stand-in: see tests/habana_shim/README.md."""
