"""ResBM's config section, `model.codec.resbm` (used when model.codec.kind = resbm)."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from nanotron_ext.config.checks import require, require_finite

DEFAULT_RATIO = 4.0  # the compression when neither h nor ratio is given


@dataclasses.dataclass(kw_only=True)
class ResBMConfig:
    """ResBM bottlenecks ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism",
    arXiv:2604.11947), used when model.codec.kind = resbm. The paper leaves m, the nonlinearity and the
    norm placement open; the defaults here are our choices."""

    h: Optional[int] = None
    """Wire width h (< hidden_size); or give `ratio` instead."""
    ratio: Optional[float] = None
    """Compression hidden_size / h (h = round(hidden_size / ratio)); e.g. 128 -> h = 32 at d = 4096. Unset with
    h unset too: 4 (config show prints the 4)."""
    m: Optional[int] = None
    """Hidden width of the encoder (d -> m -> h) and decoder (h -> m -> d); default hidden_size // 4."""
    nonlinearity: Literal["silu", "gelu", "relu", "tanh", "identity"] = "silu"
    """Between the two linears of the encoder and of the decoder."""
    norm: Literal["none", "encoder", "decoder", "both"] = "none"
    """Extra RMSNorm on the encoder input (d wide) and/or the decoder input (h wide). The receiving
    attention's own pre-norm always normalises D(b)."""
    zero_init_encoder: bool = True
    """Zero-init the encoder's last linear: at init b = trunc_h(x_attn), the pure identity path."""
    zero_init_decoder: bool = False
    """Zero-init the decoder's last linear (then the receiving attention sees 0 at init)."""

    def __post_init__(self) -> None:
        require_finite(self, "model.codec.resbm")
        if self.h is None and self.ratio is None:  # here, not in the field: a given h must not meet a default ratio
            self.ratio = DEFAULT_RATIO
        require(self.h is None or self.ratio is None, "model.codec.resbm",
                "give exactly one of model.codec.resbm.h and model.codec.resbm.ratio")
        require(self.h is None or self.h >= 1, "model.codec.resbm.h", f"must be >= 1, got {self.h}")
        require(self.ratio is None or self.ratio > 1, "model.codec.resbm.ratio", f"must be > 1, got {self.ratio}")
        require(self.m is None or self.m >= 1, "model.codec.resbm.m", f"must be >= 1, got {self.m}")

    def width(self, hidden_size: int) -> int:
        """The wire width h for model width `hidden_size`."""
        h = self.h if self.h is not None else max(1, round(hidden_size / self.ratio))
        require(h < hidden_size, "model.codec.resbm.h", f"{h} must be < model.hidden_size={hidden_size}")
        return h

    def hidden(self, hidden_size: int) -> int:
        """The encoder's and decoder's hidden width m (default hidden_size // 4)."""
        return self.m or hidden_size // 4

    def params_per_boundary(self, hidden_size: int) -> int:
        """Weights of one (E_l, D_{l+1}) pair: d -> m -> h and h -> m -> d, plus the optional norms."""
        d, h, m = hidden_size, self.width(hidden_size), self.hidden(hidden_size)
        norms = (d if self.norm in ("encoder", "both") else 0) + (h if self.norm in ("decoder", "both") else 0)
        return 2 * m * (d + h) + norms
