"""Simulated replicas: M SparseLoCo replicas run one after another in one process, so sweeps over
M, k, H fit on a laptop's cores. The outer step is `SparseLoCoOuter`'s, exactly as in the
distributed mode: each replica encodes its payload (the bytes it would send), the payloads are
aggregated in replica order, and every replica takes the global weights; only the all_gather is
replaced by a Python list (tests/test_sparseloco_outer.py checks bit equality with dp=2).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from nanotron_ext.config.schema import SparseLoCoConfig
from nanotron_ext.sparseloco.outer import SparseLoCoOuter


def trainable(model: nn.Module) -> List[torch.nn.Parameter]:
    """The parameters SparseLoCo synchronises, in the order SparseLoCoSync uses (named_parameters)."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


class SimulatedReplicas:
    """Outer loop over M in-process replicas (one model and one inner optimiser each, kept by the caller)."""

    def __init__(self, models: Sequence[nn.Module], cfg: SparseLoCoConfig) -> None:
        self.cfg = cfg
        self.params = [trainable(m) for m in models]
        with torch.no_grad():  # replicas start from replica 0's weights, as the distributed broadcast does
            for ps in self.params[1:]:
                for p, p0 in zip(ps, self.params[0]):
                    p.copy_(p0)
        self.outer = SparseLoCoOuter(self.params[0], cfg)
        self.errors = [self.outer.new_error() for _ in models]
        self.sent_bytes: List[int] = []  # per sync: bytes each replica would send (its payload)

    def after_step(self, step: int) -> None:
        """Call once every replica has taken inner step `step` (1-based)."""
        if step % self.cfg.inner_steps == 0:
            self.sync()

    def sync(self) -> None:
        payloads = [self.outer.encode(ps, e) for ps, e in zip(self.params, self.errors)]
        self.sent_bytes.append(payloads[0].numel())
        self.outer.apply(payloads)
        for ps in self.params:
            self.outer.load_into(ps)
