"""Habana stand-in: see habana_standin/README.md."""
