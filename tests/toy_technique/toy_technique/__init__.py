"""A toy technique: everything a sixth technique package needs, and nothing else, in the shape of the in-tree five
(ARCHITECTURE.md): config.py (its sections), technique.py (its one registered object), pieces.py (what it builds).

Paper -> code: (none; a worked example) the truncating codec -> pieces.TruncEncoder / PadDecoder; local
SGD -> pieces.AverageEvery. `technique` (technique.py) is the package's entry point: light (no torch), so a
config that names "toy_trunc" is checked without importing pieces.py.
"""
from toy_technique.technique import technique  # noqa: F401  (the entry point: light, no torch)
