"""MAPL's config sections: `model.codec.mapl` (the codec) and `optimizer.spel` (SPEL, the optimiser of its
projections). Settings the MAPL text leaves open are documented on each field."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Tuple

from nanotron_ext.config.checks import require, require_finite


@dataclasses.dataclass(kw_only=True)
class MaplCodecConfig:
    """MAPL's learned per-boundary Stiefel projection with anchor embeddings (model.codec.kind: mapl)."""

    rank: Optional[int] = None
    """Wire width r of each boundary projection A_p [d, r]; default hidden_size // 4."""
    anchor_width: Optional[int] = None
    """Width m of the trainable anchor table E_small_p [V, m] (the text does not give it); default r."""
    vq_groups: int = 0
    """Residual vector quantisation of Z: groups G per token (0 = off, send Z itself); divides r."""
    vq_rounds: int = 2
    """RVQ rounds R per group."""
    vq_codebook: int = 256
    """Entries K per codebook (indices of ceil(log2 K) bits cross the link)."""
    vq_decay: float = 0.99
    """EMA decay of the sender's k-means codebook update."""
    grad_bits: int = 8
    """With RVQ, bits per value of the quantised gradient sent back (absmax, one fp32 scale per token)."""
    shared_sync: Literal["rows", "dense"] = "rows"
    """How both copies of A_p and E_small_p stay equal: rows = the receiver sends the anchor-gradient rows of
    the step's ids and the A partials are swapped, in the wire dtype ((d r + U m) per step back, d r forth);
    dense = full fp32 gradients of both swapped ((d r + V m) x 4 B each way; nanotron_ext/mapl/codec.py)."""

    def __post_init__(self) -> None:
        require_finite(self, "model.codec.mapl")
        for key in ("rank", "anchor_width"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"model.codec.mapl.{key}", f"must be >= 1, got {value}")
        require(self.vq_groups >= 0, "model.codec.mapl.vq_groups", f"must be >= 0, got {self.vq_groups}")
        require(self.vq_rounds >= 1, "model.codec.mapl.vq_rounds", f"must be >= 1, got {self.vq_rounds}")
        require(2 <= self.vq_codebook <= 2**16, "model.codec.mapl.vq_codebook",
                f"must be in [2, 65536], got {self.vq_codebook}")
        require(0 < self.vq_decay < 1, "model.codec.mapl.vq_decay", f"must be in (0, 1), got {self.vq_decay}")

    def widths(self, hidden_size: int) -> Tuple[int, int]:
        """(r, m): the wire width (default hidden_size // 4) and the anchor width (default r)."""
        r = self.rank or hidden_size // 4
        return r, self.anchor_width or r


@dataclasses.dataclass(kw_only=True)
class SpelConfig:
    """SPEL, the Stiefel optimiser of MAPL's boundary projections (settings the MAPL text leaves open)."""

    lr_scale: float = 0.1
    """SPEL lr as a multiple of the model lr (muon_lr under Muon, else lr); MAPL: 0.1."""
    momentum: float = 0.9
    """Heavy-ball momentum beta of the Riemannian gradient."""
    polar_steps: int = 5
    """PolarExpress iterations for the direction polar(m)."""
    mode: Literal["stiefel", "euclidean", "euclidean_qr", "fixed"] = "stiefel"
    """stiefel = SPEL (MAPL); the manifold-unaware ablation: euclidean (raw gradient, no retraction: A leaves
    the manifold), euclidean_qr (the same step, then QR re-orthonormalisation), fixed (A never trained)."""

    def __post_init__(self) -> None:
        require_finite(self, "optimizer.spel")
        require(self.lr_scale > 0, "optimizer.spel.lr_scale", f"must be > 0, got {self.lr_scale}")
        require(0 <= self.momentum < 1, "optimizer.spel.momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.polar_steps >= 1, "optimizer.spel.polar_steps", f"must be >= 1, got {self.polar_steps}")
