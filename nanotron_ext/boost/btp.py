"""Collectives and tensor-parallel linears for low-rank (bottleneck) TP, vanilla and BOOST's BTP.

Written in the style of nanotron's distributed_differentiable_primitives.py: each autograd
collective is a small Function whose backward is the collective's adjoint, and every one returns
early on a one-rank group. Activations are sharded on their LAST dim (features); nanotron's
gather/scatter helpers work on dim 0, so the features are moved to the front around the call.

    gather_features           fwd all-gather      bwd keep own slice   (sharded -> replicated)
    split_features            fwd keep own slice  bwd all-gather       (replicated -> sharded)
    reduce_scatter_features   fwd reduce-scatter  bwd all-gather       (partial sums -> sharded)
    all_reduce_statistic      fwd all-reduce      bwd all-reduce       (a sum every rank applies to its own shard)
    all_reduce_flat           several partial sums in ONE all-reduce (nanotron's differentiable all-reduce
                              on a flat buffer; bwd identity like any row-parallel g)

The linears subclass nanotron's TensorParallelColumnLinear / TensorParallelRowLinear and add
`local(x)`: this rank's GEMM without the collective, so a caller can share one collective between
several GEMMs (grouping) or keep collectives out of a recomputed region (low-rank checkpointing).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_all_reduce_sum,
)
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelRowLinear,
)
from torch import nn


# -- raw last-dim collectives (no autograd) --------------------------------------------------------
def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    front = x.movedim(-1, 0).contiguous()
    out = torch.empty((front.shape[0] * group.size(), *front.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, -1)


def _reduce_scatter_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    front = x.movedim(-1, 0).contiguous()
    if front.shape[0] % group.size():
        raise ValueError(f"cannot reduce-scatter {front.shape[0]} features over {group.size()} ranks")
    out = torch.empty((front.shape[0] // group.size(), *front.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, front, group=group, op=dist.ReduceOp.SUM)
    return out.movedim(0, -1)


def _own_slice_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    width = x.shape[-1] // group.size()
    rank = dist.get_rank(group)
    return x[..., rank * width:(rank + 1) * width].contiguous()


# -- autograd pairs ----------------------------------------------------------------------------------
class _GatherFeatures(torch.autograd.Function):
    """Sharded -> replicated. The consumer is replicated and sees the full gradient: keep own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x if group.size() == 1 else _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SplitFeatures.apply(grad, ctx.group), None


class _SplitFeatures(torch.autograd.Function):
    """Replicated -> sharded. Each rank's gradient covers its slice only: gather them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x if group.size() == 1 else _own_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFeatures.apply(grad, ctx.group), None


class _ReduceScatterFeatures(torch.autograd.Function):
    """Partial sums -> this rank's slice of the sum; the adjoint is an all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x if group.size() == 1 else _reduce_scatter_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        return (grad if group.size() == 1 else _all_gather_last(grad, group)), None


class _AllReduceStatistic(torch.autograd.Function):
    """Sum of per-rank statistics that every rank then applies to its OWN shard (Sync RMSNorm).

    Unlike a row-parallel output (replicated consumers, identity backward), each rank's gradient of
    the sum is only its own shard's contribution, so the backward is an all-reduce too.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        if group.size() == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceStatistic.apply(grad, ctx.group), None


def gather_features(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherFeatures.apply(x, group)


def split_features(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SplitFeatures.apply(x, group)


def reduce_scatter_features(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceScatterFeatures.apply(x, group)


def all_reduce_statistic(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _AllReduceStatistic.apply(x, group)


def all_reduce_flat(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> List[torch.Tensor]:
    """Sum each tensor over `group` with ONE all-reduce of a flat buffer (one ledger call).

    Forward all-reduce, backward identity (nanotron's row-parallel g): the results must feed
    replicated computation. The single-tensor case reduces in place, so pass freshly made tensors.
    """
    if group.size() == 1 or not tensors:
        return list(tensors)
    if len(tensors) == 1:
        return [differentiable_all_reduce_sum(tensors[0].contiguous(), group=group)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = differentiable_all_reduce_sum(flat, group=group)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


# -- linears -----------------------------------------------------------------------------------------
class ColumnParallelLinear(TensorParallelColumnLinear):
    """nanotron's column-parallel linear (output features sharded) with a collective-free `local`."""

    def __init__(self, in_features: int, out_features: int, pg: dist.ProcessGroup, **kwargs) -> None:
        super().__init__(in_features, out_features, pg=pg, mode=TensorParallelLinearMode.ALL_REDUCE,
                         bias=False, **kwargs)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x must already be marked for the backward all-reduce (nanotron's f) by the caller."""
        return F.linear(x, self.weight)


class RowParallelLinear(TensorParallelRowLinear):
    """nanotron's row-parallel linear (input features sharded) with a collective-free `local`."""

    def __init__(self, in_features: int, out_features: int, pg: dist.ProcessGroup, **kwargs) -> None:
        super().__init__(in_features, out_features, pg=pg, mode=TensorParallelLinearMode.ALL_REDUCE,
                         bias=False, **kwargs)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum; the caller reduces it (all-reduce or reduce-scatter)."""
        return F.linear(x, self.weight)


class ReplicatedLinear(nn.Linear):
    """An unsharded linear every TP rank computes in full: the fallback when a width does not split."""

    def __init__(self, in_features: int, out_features: int, pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(in_features, out_features, bias=False)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
