"""Global gradient-norm clipping across tensor- and pipeline-parallel ranks.

Each gradient element of the model replica must be counted exactly once:

* tied params (nanotron `mark_as_tied`, e.g. a weight shared across stages or TP ranks): only on
  the first rank of the tie;
* TP-sharded params: every rank's shard (the shards partition the matrix);
* any other param: only on TP rank 0. These are replicated over TP (norm weights, with identical
  grads on every TP rank) or exist on TP rank 0 alone (the bias of nanotron's row-parallel linear).

The counted squares are summed, all-reduced over TP, then over PP; DP replicas are assumed to
hold already-averaged, identical grads, so DP is not reduced. Each tensor's norm is accumulated in
float64: torch's fp32 norm on CPU is off by up to ~1e-4 relative on a large, uneven gradient (a
4096 x 128 embedding: 8e-5), and by a different amount for each TP shard layout, so clipping would
scale the same gradient differently at TP = 1 and TP = 2 (BOOST Fig. 4 found it). The clip itself
is torch's (`clip_grads_with_norm_`: coef = max_norm / (norm + 1e-6), clamped to 1), so the result
matches torch.nn.utils.clip_grad_norm_ on the unsharded model.
"""
from __future__ import annotations

from typing import Iterable, Optional

import nanotron.distributed as dist
import torch


def _counted_here(p: torch.Tensor, tp_rank: int) -> bool:
    if getattr(p, "is_tied", False):
        return dist.get_rank() == p.get_tied_info().global_ranks[0]
    if getattr(p, "is_sharded", False) and len(p.get_sharded_info().global_ranks) > 1:
        return True
    return tp_rank == 0


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    tp_pg: Optional[dist.ProcessGroup],
    pp_pg: Optional[dist.ProcessGroup],
) -> float:
    """`clip_grad_norm_device_`, the norm read back to the host (a sync on CUDA)."""
    return float(clip_grad_norm_device_(params, max_norm, tp_pg, pp_pg))


@torch.no_grad()
def clip_grad_norm_device_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    tp_pg: Optional[dist.ProcessGroup],
    pp_pg: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """Clip grads in place to a global L2 norm of `max_norm` and return the norm before clipping, a 0-d tensor on
    the grads' device: nothing is read back (the clip multiplies by a scale computed on the device), so a step can
    decide on it without a host sync (nanotron_ext.train.step_guard).

    max_norm <= 0 only measures (config `clip_grad: 0` = off, the norm is still worth logging).
    tp_pg / pp_pg None (or of size 1) means that dimension is not split. Collective over both
    groups: every rank of the replica must call it. Non-finite norms are not special-cased
    (same as torch: the grads become non-finite and the caller sees it in the returned norm).
    """
    params = [p for p in params if p.grad is not None]
    tp_split = tp_pg is not None and tp_pg.size() > 1
    if not tp_split and any(getattr(p, "is_sharded", False) and len(p.get_sharded_info().global_ranks) > 1
                            for p in params):
        raise ValueError("clip_grad_norm_: parameters are sharded over several ranks but no TP group was given")
    tp_rank = dist.get_rank(tp_pg) if tp_split else 0
    counted = [p.grad for p in params if _counted_here(p, tp_rank)]
    device = params[0].grad.device if params else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Squares summed in float64 (module docstring): the norm must not depend on how TP shards a tensor.
    # One foreach call (a few kernels on CUDA, not four per tensor); each norm is vector_norm's, in float64.
    norms = torch._foreach_norm(counted, 2, dtype=torch.float64) if counted else []
    sq = torch.stack([n.to(device) for n in norms]).square().sum() if norms else \
        torch.zeros((), device=device, dtype=torch.float64)
    for pg in (tp_pg, pp_pg):
        if pg is not None and pg.size() > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pg)
    total = sq.sqrt().to(torch.promote_types(params[0].grad.dtype, torch.float32) if params else torch.float32)
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
