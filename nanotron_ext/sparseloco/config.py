"""SparseLoCo's config section, `sparseloco` (used when parallelism.dp_sync = sparseloco)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List, Literal

from nanotron_ext.config.checks import require, require_finite


@dataclasses.dataclass(kw_only=True)
class FaultToleranceConfig:
    """Replicas that leave and rejoin (sparseloco.fault_tolerance; docs/techniques/sparseloco.md): each
    replica is its own job (parallelism.dp = 1) and a torchft replica group; the outer sync runs a torchft
    quorum and gathers the payloads over torchft's reconfigurable process group among the replicas present."""

    enabled: bool = False
    """Run the outer loop on torchft (needs the `ft` extra: pip install -e '.[ft]')."""
    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (`torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510`); each replica's
    torchft services listen on the local end of the route to it (127.0.0.1 here), not on all interfaces."""
    replica: int = 0
    """This job's replica index (its torchft replica id is sparseloco_<replica>; its data shard)."""
    replicas: int = 1
    """Replicas the data is split into (each reads shard `replica` of `replicas`); not a quorum size."""
    min_replicas: int = 1
    """Fewest replicas an outer sync commits with (fewer: the sync is retried with the next quorum)."""
    timeout_s: float = 30.0
    """Bound on each outer collective, recovery transfer and commit vote (a dead peer turns into a retry)."""
    quorum_timeout_s: float = 600.0
    """Bound on waiting for a quorum (longer than an inner loop: peers join at their own next sync), and for a
    lighthouse that does not answer (the replicas say so and rejoin it once restarted; past it they stop)."""
    max_retries: int = 5
    """Failed attempts of one outer sync (a peer died mid-collective) before the run stops."""


@dataclasses.dataclass(kw_only=True)
class ChurnConfig:
    """Emulated churn in one job (sparseloco.churn; the WAN meter's churn scenario): in the first `down_syncs` of
    every `period` outer syncs one replica, replica c mod dp in cycle c, is absent. An absent replica's inner loop
    before that sync does not count (its payload is dropped on arrival: the others average over the replicas
    present), its error feedback is lost (it rejoins with zero), and it takes the global weights after the sync
    (the state a live peer heals it with; with sparseloco.streaming.delay > 0 it takes them at the send, trains the
    delay's steps from them and merges on arrival as the others do). The DP collective keeps its shape, so its slot
    still crosses (the bytes are those of the run without churn) and its compute is spent: churn costs progress, not
    step time. Replicas that really die and rejoin: sparseloco.fault_tolerance (torchft)."""

    down_syncs: int = 0
    """Outer syncs per cycle that one replica misses (0: no churn). 1 of period 5: down 20% of the time."""
    period: int = 5
    """Outer syncs per churn cycle; the absent replica rotates from cycle to cycle."""


@dataclasses.dataclass(kw_only=True)
class StreamingConfig:
    """Streaming outer sync (sparseloco.streaming; "Streaming DiLoCo with overlapping communication", arXiv:2501.18512,
    one fragment: the whole model): the outer sync's all_gather runs on a side thread over its own DP group behind
    the next `delay` inner steps; on arrival the outer step is taken from the global weights and each replica merges
    it into the weights it trained meanwhile. Same payload, same bytes as the blocking sync."""

    delay: int = 0
    """tau: inner steps between sending the pseudo-gradient (at every multiple of inner_steps) and applying the outer
    step it gives (0: the blocking sync, today's algorithm bit for bit; must be < inner_steps, as in torchft)."""
    alpha: float = 0.5
    """Mixing on arrival: local = alpha * local + (1 - alpha) * global_new (the paper's 0.5; torchft's
    fragment_update_alpha, 0 there: the local steps made during the delay are dropped). Unused at delay 0."""


@dataclasses.dataclass(kw_only=True)
class SparseLoCoConfig:
    """SparseLoCo outer loop (parallelism.dp_sync=sparseloco; "Heterogeneous Low-Bandwidth Pre-Training
    of LLMs"): H inner steps with no DP traffic, then compressed pseudo-gradients are exchanged."""

    inner_steps: int = 50
    """H: inner optimiser steps between outer syncs (paper: 50)."""
    chunk: int = 4096
    """Elements per chunk; 2-D tensors are tiled sqrt(chunk) x sqrt(chunk) (64 x 64), others in runs."""
    topk: int = 32
    """Entries kept per chunk (paper: 32 of 4096)."""
    beta: float = 0.95
    """Error-feedback decay: e = beta * e + delta."""
    quant_bits: int = 0
    """Value quantisation bits (0 = none; 2 = the public code's option)."""
    value_dtype: Literal["fp32", "bf16"] = "bf16"
    """Precision of the sent values without quantisation."""
    index_bits: int = 12
    """Bits per packed index; 2**index_bits must cover the chunk."""
    outer_lr: float = 1.0
    """Outer SGD learning rate (paper: 1.0; 0.8 in tuned runs)."""
    outer_momentum: float = 0.0
    """Outer SGD momentum (paper: none; DiLoCo, arXiv:2311.08105: 0.9 with Nesterov, outer lr 0.7)."""
    outer_nesterov: bool = False
    """Nesterov outer momentum, as torch.optim.SGD(nesterov=True): b = mu b + delta, step lr (delta + mu b)
    (DiLoCo's outer optimiser); off: heavy ball, step lr b. Needs outer_momentum > 0."""
    aggregate: Literal["all", "senders"] = "all"
    """Average each position over all replicas, or over the replicas that sent it (public code)."""
    compressed_replicas: List[int] = field(default_factory=list)
    """Heterogeneous SparseLoCo (sec. 2.3): DP replicas whose pipeline uses the subspace codec (options under
    model.subspace); the others run uncompressed. Empty: plain SparseLoCo, the model as configured."""
    embedding_adaptation: bool = True
    """Heterogeneous (sec. 2.4): T_S = T U U^T, T_fixed = T - T U U^T at start; after every sync fold
    T_S - T_S U U^T into T_fixed. Off: T_fixed is the subspace package's seeded table, never adapted."""
    weight_projection: bool = False
    """Heterogeneous: compressed replicas re-project their output projections onto span(U) after every step."""
    modified_adamw: bool = False
    """Heterogeneous: compressed replicas step their output projections with the subspace modified AdamW."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Replicas that leave and rejoin, on torchft (sparseloco.fault_tolerance.*)."""
    churn: ChurnConfig = field(default_factory=ChurnConfig)
    """Emulated churn: one replica misses some outer syncs (sparseloco.churn.*; the WAN meter's churn rows)."""
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    """Overlap the outer sync with the next inner steps (sparseloco.streaming.delay, .alpha; off by default)."""
    grassmann_every: int = 0
    """Heterogeneous: Grassmann updates of the one U all replicas share, every N inner steps (a multiple of
    inner_steps: the update runs at an outer sync, from A averaged over the compressed replicas; step size
    and reset under model.subspace). 0 = the fixed random U (the paper's default)."""

    def __post_init__(self) -> None:
        k = "sparseloco"
        ft = self.fault_tolerance
        f = f"{k}.fault_tolerance"
        require(ft.replicas >= 1, f"{f}.replicas", f"must be >= 1, got {ft.replicas}")
        require(0 <= ft.replica < ft.replicas, f"{f}.replica",
                f"must be in [0, {f}.replicas={ft.replicas}), got {ft.replica}")
        require(1 <= ft.min_replicas <= ft.replicas, f"{f}.min_replicas",  # more: no sync ever commits
                f"must be in [1, {f}.replicas={ft.replicas}], got {ft.min_replicas}")
        require(ft.timeout_s > 0 and ft.quorum_timeout_s > 0, f"{f}.timeout_s",
                f"timeouts must be > 0, got {ft.timeout_s} and {ft.quorum_timeout_s}")
        require(ft.max_retries >= 0, f"{f}.max_retries", f"must be >= 0, got {ft.max_retries}")
        require(ft.lighthouse.startswith(("http://", "https://")), f"{f}.lighthouse",
                f"must be an http:// address, got {ft.lighthouse!r}")
        require_finite(self, k)
        c = self.churn
        require(c.period >= 1, f"{k}.churn.period", f"must be >= 1, got {c.period}")
        require(0 <= c.down_syncs <= c.period, f"{k}.churn.down_syncs",
                f"must be in [0, {k}.churn.period={c.period}], got {c.down_syncs}")
        require(all(r >= 0 for r in self.compressed_replicas), f"{k}.compressed_replicas",
                f"must list DP ranks >= 0, got {self.compressed_replicas}")
        require(self.inner_steps >= 1, f"{k}.inner_steps", f"must be >= 1, got {self.inner_steps}")
        require(self.chunk >= 1 and int(self.chunk**0.5) ** 2 == self.chunk, f"{k}.chunk",
                 f"must be a perfect square (2-D tiles are square), got {self.chunk}")
        require(1 <= self.topk <= self.chunk, f"{k}.topk", f"must be in [1, {k}.chunk={self.chunk}], got {self.topk}")
        require(0 <= self.beta <= 1, f"{k}.beta", f"must be in [0, 1], got {self.beta}")
        require(0 <= self.quant_bits <= 8, f"{k}.quant_bits", f"must be in [0, 8], got {self.quant_bits}")
        require(1 <= self.index_bits <= 32 and 2**self.index_bits >= self.chunk, f"{k}.index_bits",
                 f"{self.index_bits} bits cannot address {k}.chunk={self.chunk} positions")
        require(self.outer_lr > 0, f"{k}.outer_lr", f"must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"{k}.outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        require(not self.outer_nesterov or self.outer_momentum > 0, f"{k}.outer_nesterov",
                f"Nesterov needs a momentum; set {k}.outer_momentum > 0 (DiLoCo: 0.9), got {self.outer_momentum}")
        st = self.streaming
        require(0 <= st.delay < self.inner_steps, f"{k}.streaming.delay",
                f"must be in [0, {k}.inner_steps={self.inner_steps}) (an outer step lands before the next is sent), "
                f"got {st.delay}")
        require(0 <= st.alpha <= 1, f"{k}.streaming.alpha", f"must be in [0, 1], got {st.alpha}")
        require(self.grassmann_every >= 0 and self.grassmann_every % self.inner_steps == 0, f"{k}.grassmann_every",
                f"must be 0 or a multiple of {k}.inner_steps={self.inner_steps} (updates run at outer syncs), "
                f"got {self.grassmann_every}")
        require(not self.grassmann_every or self.compressed_replicas, f"{k}.grassmann_every",
                f"needs {k}.compressed_replicas (the compressed replicas' gradients drive U)")
