"""Reproduction scripts, one folder per paper (see reproduce/README.md)."""
