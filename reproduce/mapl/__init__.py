"""MAPL reproduction scripts (importable for their shared helpers in common.py)."""
