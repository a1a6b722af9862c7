"""BOOST's config sections: `model.low_rank` (which linears are factorised, and how) and `model.boost`
(options of its TP strategies). The strategy itself is chosen by the core key `model.tp_strategy`."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List, Literal, Optional

from nanotron_ext.config.checks import require

LOW_RANK_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(kw_only=True)
class LowRankConfig:
    """Low-rank factorisation of the attention and MLP linears (BOOST paper)."""

    kind: Literal["none", "svd", "cola", "lax"] = "none"
    """none = full rank; svd y=A(Bx); cola y=A silu(Bx); lax y_i=B_i(A_i x_i + A_{i-1} x_{i-1}). A low-rank
    model takes BOOST's vanilla TP layout unless model.tp_strategy names one (btp)."""
    rank: Optional[int] = None
    """Bottleneck width r (at most model.hidden_size); default hidden_size // 4 (BOOST Table 8)."""
    targets: List[str] = field(default_factory=lambda: list(LOW_RANK_TARGETS))
    """Which linears are factorised."""

    def __post_init__(self) -> None:
        bad = set(self.targets) - set(LOW_RANK_TARGETS)
        require(not bad, "model.low_rank.targets", f"unknown {sorted(bad)}; allowed: {sorted(LOW_RANK_TARGETS)}")
        require(self.rank is None or self.rank >= 1, "model.low_rank.rank", f"must be >= 1, got {self.rank}")

    def width(self, hidden_size: int) -> int:
        """The bottleneck width r for model width `hidden_size`."""
        return self.rank or hidden_size // 4


@dataclasses.dataclass(kw_only=True)
class BoostConfig:
    """Options of BOOST's TP strategies (model.tp_strategy: vanilla or btp)."""

    rmsnorm: Literal["online", "sync"] = "online"
    """Norms inside a BTP chunk: online (statistic rides in the next all-reduce) or sync (own all-reduce)."""
    group_linears: bool = True
    """Concatenate down-projections sharing an input; batch up-projections with distinct inputs."""
    lowrank_checkpointing: bool = False
    """Keep only the r-wide chunk boundaries; recompute inside chunks in backward (no collectives)."""
