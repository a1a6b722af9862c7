"""Models built from nanotron's parallel primitives."""
