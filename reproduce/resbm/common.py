"""What the ResBM scripts share ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism",
arXiv:2604.11947)."""
from __future__ import annotations


def nearest_h(d: int, ratio: float) -> int:
    """The wire width whose d / h is nearest `ratio` (at d = 4096: 100x -> 40, 128x -> 32; at d = 256: 3, 2)."""
    return min(range(1, d + 1), key=lambda h: (abs(d / h - ratio), h))
