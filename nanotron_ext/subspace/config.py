"""Subspace Models' config section, `model.subspace`."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from nanotron_ext.config.checks import require, require_finite, require_seed


@dataclasses.dataclass(kw_only=True)
class SubspaceConfig:
    """Subspace (Protocol) Models, nanotron_ext.subspace: one shared basis U (d x k) confines what every
    compressed block writes into the residual stream, so a boundary sends k coordinates and the token ids.
    Used when model.codec.kind = subspace (which brings the split embedding and the span(U) constraint)."""

    k: Optional[int] = None
    """Subspace width k (columns of U); default hidden_size // 8."""
    seed: int = 0
    """Seed of U (QR of a Gaussian) and of the fixed embedding T_fixed: identical on every rank."""
    parameterisation: Literal["projection", "reparam"] = "reparam"
    """projection: full output weights kept in span(U) by projection; reparam: W_out = U W_small (exact by
    construction)."""
    reproject: bool = True
    """projection only: project the output weights onto span(U) after every optimiser step."""
    modified_adamw: bool = False
    """projection only: the paper's sec. 5 AdamW (second moment averaged to one scalar per input column)."""
    fixed_embedding_std: Optional[float] = None
    """Std of the seeded T_fixed (not trained); default model.init_std."""
    last_block_uncompressed: bool = True
    """Leave the last decoder block's output projections unconstrained (it feeds the head, never a boundary)."""
    grassmann_every: int = 0
    """Optimiser steps between Grassmann updates of U (0 = U stays fixed)."""
    grassmann_lr: float = 0.1
    """Step size of the Grassmann update, on the accumulated A normalised to unit spectral norm."""
    grassmann_reset: bool = True
    """Reset the accumulated A = sum G^T G after each Grassmann update."""

    def __post_init__(self) -> None:
        require_finite(self, "model.subspace")
        require(self.k is None or self.k >= 1, "model.subspace.k", f"must be >= 1, got {self.k}")
        require_seed(self.seed, "model.subspace.seed")
        require(self.grassmann_every >= 0, "model.subspace.grassmann_every", "must be >= 0")
        require(self.grassmann_lr > 0, "model.subspace.grassmann_lr", f"must be > 0, got {self.grassmann_lr}")


    def width(self, hidden_size: int) -> int:
        """The subspace width k for model width `hidden_size` (default hidden_size // 8)."""
        return self.k or max(1, hidden_size // 8)
