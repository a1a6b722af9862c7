"""Gradient averaging across data-parallel replicas, bucketed into flat buffers.

Written out rather than wrapping the model in DDP: nanotron's PipelineBlocks and engines drive
backward themselves, and an explicit all-reduce after the last micro-batch is simpler to
reason about, to count (group "dp") and to replace (SparseLoCo's outer sync does).

`DataParallelSync` is that replacement point (`parallelism.dp_sync`, built by a technique's Pieces): the trainer
calls `after_backward` once a step's gradients are complete and `after_step` after the optimiser
step; its `state_dict` travels in checkpoints. The default, "allreduce", averages gradients.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn


class DataParallelSync:
    """How data-parallel replicas agree; one instance per rank, over its DP group."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Optional[Any] = None) -> None:
        # cfg: this replica's nanotron_ext.config.Config (typed Any: parallel/ does not import config/); outer
        # loops read their own section from it, the per-step all-reduce needs none
        self.model, self.ctx, self.dp_pg, self.cfg = model, ctx, ctx.dp_pg, cfg

    def data_shard(self, dp_rank: int, dp_size: int) -> Tuple[int, int]:
        """(shard, shards) of the training data this replica reads: its DP rank of the DP size, unless replicas
        are separate jobs (fault-tolerant outer loops: each job has dp = 1)."""
        return dp_rank, dp_size

    def start(self) -> None:
        """Before the first step of a launch, once this rank's own state (a checkpoint) is loaded: an outer loop
        whose replicas come and go joins the others here."""

    def after_backward(self) -> None:
        """The step's gradients are complete on this replica (before clipping and the optimiser step)."""

    def after_step(self, step: int) -> None:
        """The optimiser has taken step number `step` (1-based)."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint has {sorted(state)}")


class GradientAllReduce(DataParallelSync):
    """Classic data parallelism: average gradients over the DP group every step."""

    def after_backward(self) -> None:
        allreduce_gradients_(self.model.parameters(), self.dp_pg)


def allreduce_gradients_(params: Iterable[torch.nn.Parameter], dp_pg: dist.ProcessGroup,
                         bucket_mb: float = 25.0) -> None:
    """Average `.grad` of `params` over `dp_pg` in place (gloo has no AVG: sum, then divide)."""
    if dp_pg.size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    limit = int(bucket_mb * 2**20)
    bucket: List[torch.Tensor] = []
    size = 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= limit:
            _reduce_bucket(bucket, dp_pg)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, dp_pg)


def _reduce_bucket(grads: List[torch.Tensor], dp_pg: dist.ProcessGroup) -> None:
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_pg)
        flat.div_(dp_pg.size())
        for g, reduced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)
