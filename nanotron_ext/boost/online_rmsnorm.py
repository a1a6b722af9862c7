"""RMSNorm over a feature-sharded activation, inside a BTP chunk (BOOST sec. 4.2).

Under BTP the residual stream is sharded on d, so the pre-norm of each sub-layer sees d/tp
features per rank and the following GEMM is row-parallel. Two exact ways to normalise:

Sync RMSNorm: all-reduce the per-token sum of squares ([b, s, 1]) first, then normalise with the
global statistic. One extra collective per norm in the forward AND one in the backward (each rank's
gradient of the shared statistic covers only its own shard).

Online RMSNorm (Algorithm 1): normalise with the LOCAL statistic, run the row-parallel GEMM,
multiply the partial output by rms_local, and all-reduce [H_i * rms_local, S_local] as ONE flat
buffer; then divide by rms_global = sqrt(S_global / d + eps). Exact in real arithmetic:

    sum_i W_i (x_i g_i / rms_i) * rms_i / rms = sum_i W_i (x_i g_i) / rms.

The statistic costs one element per token inside the chunk's own all-reduce and no backward
collective (the reduced buffer feeds replicated computation, like any row-parallel output).
The statistic travels in the GEMM output's dtype (bf16 under bf16 training): its rounding is of
the same order as the rounding of the reduced GEMM output itself.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import (
    SplitConfig,
    mark_all_parameters_in_module_as_sharded,
)
from torch import nn

from nanotron_ext.boost.btp import all_reduce_flat, all_reduce_statistic


class ShardedRMSNorm(nn.Module):
    """RMSNorm whose input and weight are both sharded on the normalised (last) dim over `tp_pg`."""

    def __init__(self, dim: int, eps: float, tp_pg: dist.ProcessGroup, mode: str = "online") -> None:
        super().__init__()
        if mode not in ("online", "sync"):
            raise ValueError(f"RMSNorm mode must be 'online' or 'sync', got {mode!r}")
        tp = tp_pg.size()
        if dim % tp:
            raise ValueError(f"cannot shard an RMSNorm of width {dim} over {tp} TP ranks")
        self.dim, self.eps, self.mode, self.tp_pg = dim, eps, mode, tp_pg
        self.weight = nn.Parameter(torch.ones(dim // tp))
        mark_all_parameters_in_module_as_sharded(self, pg=tp_pg, split_config=SplitConfig(split_dim=0))

    @staticmethod
    def local_statistic(x: torch.Tensor) -> torch.Tensor:
        """Per-token sum of squares of this rank's features, fp32, [..., 1] (Alg. 1 line 1)."""
        return x.float().pow(2).sum(-1, keepdim=True)

    def sync_statistic(self, x: torch.Tensor) -> torch.Tensor:
        """Sync RMSNorm: the global sum of squares, one all-reduce of [..., 1] in each pass."""
        return all_reduce_statistic(self.local_statistic(x), self.tp_pg)

    def normalise_sync(self, x: torch.Tensor, s_global: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.rsqrt(s_global / self.dim + self.eps) * self.weight.float()).to(x.dtype)

    def normalise_online(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_i g_i / rms_local, rms_local, S_local): Alg. 1 lines 1-3."""
        s_local = self.local_statistic(x)
        rms_local = torch.sqrt(s_local / x.shape[-1] + self.eps)
        return (x.float() / rms_local * self.weight.float()).to(x.dtype), rms_local, s_local


def rescale_local(partial: torch.Tensor, rms_local: torch.Tensor) -> torch.Tensor:
    """H_i * rms_local (Alg. 1 line 5), multiplied in fp32 and rounded once to the partial's dtype."""
    return (partial.float() * rms_local).to(partial.dtype)


def fold_statistic(partial: torch.Tensor, rms_local: torch.Tensor, s_local: torch.Tensor) -> torch.Tensor:
    """The buffer Alg. 1 all-reduces (lines 5-6): [H_i * rms_local, S_local] along the last dim."""
    return torch.cat([rescale_local(partial, rms_local), s_local.to(partial.dtype)], dim=-1)


def unfold_statistic(reduced: torch.Tensor, dim: int, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a reduced buffer into (H_global / rms_global, rms_global): Alg. 1 lines 7-8."""
    h, s_global = reduced[..., :-1], reduced[..., -1:]
    rms_global = torch.sqrt(s_global.float() / dim + eps)
    return (h.float() / rms_global).to(h.dtype), rms_global


def rmsnorm_row_linear(x: torch.Tensor, norm: ShardedRMSNorm, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm then a row-parallel linear (weight: this rank's [out, d/tp] slice) -> replicated [..., out].

    Online mode issues one all-reduce in total; sync mode two (statistic, then GEMM output).
    """
    if norm.mode == "online":
        x_hat, rms_local, s_local = norm.normalise_online(x)
        (reduced,) = all_reduce_flat([fold_statistic(F.linear(x_hat, weight), rms_local, s_local)], norm.tp_pg)
        return unfold_statistic(reduced, norm.dim, norm.eps)[0]
    x_hat = norm.normalise_sync(x, norm.sync_statistic(x))
    return all_reduce_flat([F.linear(x_hat, weight)], norm.tp_pg)[0]
