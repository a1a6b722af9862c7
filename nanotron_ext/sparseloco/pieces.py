"""What SparseLoCo builds for a model: its DP sync (parallelism.dp_sync = sparseloco)."""
from __future__ import annotations

from typing import Any

from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.parallel.data_parallel import DataParallelSync
from nanotron_ext.sparseloco.outer import SparseLoCoSync
from nanotron_ext.technique import Pieces


class SparseLoCoPieces(Pieces):
    def dp_sync(self, name: str, model: nn.Module, ctx: ParallelContext, cfg: Any) -> DataParallelSync:
        if cfg.sparseloco.fault_tolerance.enabled:  # torchft is imported only here (the `ft` extra)
            from nanotron_ext.sparseloco.fault import FaultTolerantSparseLoCoSync
            from nanotron_ext.sparseloco.fault_streaming import StreamingFaultTolerantSparseLoCoSync

            streaming = cfg.sparseloco.streaming.delay
            return (StreamingFaultTolerantSparseLoCoSync if streaming else FaultTolerantSparseLoCoSync)(model, ctx, cfg)
        if cfg.sparseloco.streaming.delay:  # delay 0: the blocking sync, unchanged
            from nanotron_ext.sparseloco.streaming import StreamingSparseLoCoSync

            return StreamingSparseLoCoSync(model, ctx, cfg)
        return SparseLoCoSync(model, ctx, cfg)
