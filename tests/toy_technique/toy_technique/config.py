"""The toy technique's config sections: one under a core section (model.codec.toy), one at the top level."""
from __future__ import annotations

import dataclasses

from nanotron_ext.config.checks import require


@dataclasses.dataclass(kw_only=True)
class ToyCodecConfig:
    """Options of the toy_trunc codec (model.codec.kind: toy_trunc): the wire keeps the first `width` features."""

    width: int = 8
    """Features that cross the boundary (the rest arrive as zeros); < model.hidden_size."""

    def __post_init__(self) -> None:
        require(self.width >= 1, "model.codec.toy.width", f"must be >= 1, got {self.width}")


@dataclasses.dataclass(kw_only=True)
class ToySyncConfig:
    """Options of the toy_average DP sync (parallelism.dp_sync: toy_average): local SGD."""

    every: int = 2
    """Optimiser steps between parameter averages over the DP group."""

    def __post_init__(self) -> None:
        require(self.every >= 1, "toy_sync.every", f"must be >= 1, got {self.every}")
