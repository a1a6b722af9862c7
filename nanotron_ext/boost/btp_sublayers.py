"""Bottleneck-aware TP sub-layers: collectives only on r-wide latents, residual sharded on d
(BOOST sec. 4, Table 6: 7bsr per block per pass), norms online or sync inside the chunk."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_identity,
)
from torch import nn

from nanotron_ext.boost.btp import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_flat,
    reduce_scatter_features,
)
from nanotron_ext.boost.lowrank import (
    LatentRelay,
    LinearSpec,
    latent,
    maybe_checkpoint,
    warn_once,
)
from nanotron_ext.boost.online_rmsnorm import (
    ShardedRMSNorm,
    fold_statistic,
    rescale_local,
    unfold_statistic,
)
from nanotron_ext.boost.sublayer import MLP, Attention, LowRankPair, Sublayer, Tensors, distinct_input_gemm
from nanotron_ext.config.schema import ModelConfig


# bottleneck-aware TP
# =====================================================================================================
class _BTPPending(NamedTuple):
    buffers: List[torch.Tensor]  # partial sums of down factors to all-reduce (the norm statistic folded into the first)
    widths: List[List[int]]  # latent widths inside each buffer
    names: List[List[str]]  # linear names inside each buffer
    full: Tensors  # partial sums of full-rank linears, reduce-scattered next


class _BTPSublayer(Sublayer):
    """Feature-sharded input -> feature-sharded output; collectives only on r-wide latents."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, relay_in: Optional[LatentRelay] = None,
                 relay_out: Optional[LatentRelay] = None) -> None:
        tp = tp_pg.size()
        for key, width in (("hidden_size", cfg.hidden_size), ("num_heads", cfg.num_heads),
                           ("num_kv_heads", cfg.num_kv_heads), ("ffn_size", cfg.ffn_size)):
            if width % tp:
                raise ValueError(f"btp shards model.{key}={width} across tp={tp} ranks: it must be divisible")
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        mode = cfg.boost.rmsnorm
        if mode == "online" and not self._factorised(self.FIRST):
            warn_once(f"online RMSNorm: no low-rank all-reduce follows the norm before {'/'.join(self.FIRST)} "
                      "(all full-rank) to carry the statistic; using sync RMSNorm there")
            mode = "sync"
        self.norm = ShardedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp_pg, mode)

    def _head_layout(self) -> Tuple[int, Optional[dist.ProcessGroup]]:
        # each rank holds different heads; one qk-norm weight serves every head (as in Megatron)
        return self.tp_pg.size(), self.tp_pg

    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        pg = self.tp_pg
        if not spec.factorised:
            return RowParallelLinear(spec.in_features, spec.out_features, pg)
        return LowRankPair(RowParallelLinear(spec.in_features, spec.rank, pg),
                           ColumnParallelLinear(spec.rank, spec.out_features, pg), self._exact_product(spec.name))

    def _partials(self, names: Sequence[str], x: torch.Tensor, rms_local=None, s_local=None) -> _BTPPending:
        """Row-parallel GEMMs of the linears reading the sharded `x` (one GEMM when grouped), folded
        into the buffers their all-reduces will carry (Online RMSNorm: x is locally normalised, so
        partials are scaled by rms_local and S_local rides in the first buffer)."""
        fact = self._factorised(names)
        full_names = [n for n in names if not self.specs[n].factorised]
        mods = [self._first_gemm(n) for n in fact + full_names]
        if self.grouped and len(mods) > 1:
            # down factors first: their slice of the one GEMM's output is already the all-reduce buffer
            y = F.linear(x, torch.cat([m.weight for m in mods]))
            k = len(fact) * (self.specs[fact[0]].rank if fact else 0)
            groups, fact_parts = ([fact], [y[..., :k]]) if fact else ([], [])
            full_parts = y[..., k:].split([m.weight.shape[0] for m in mods[len(fact):]], dim=-1)
        else:
            parts = [m.local(x) for m in mods]
            groups, fact_parts, full_parts = [[n] for n in fact], parts[:len(fact)], parts[len(fact):]
        buffers = list(fact_parts)
        if rms_local is not None:
            buffers = [fold_statistic(buffers[0], rms_local, s_local)] + [rescale_local(b, rms_local)
                                                                          for b in buffers[1:]]
            full_parts = [rescale_local(p, rms_local) for p in full_parts]
        full = dict(zip(full_names, full_parts))
        widths = [[self.specs[n].rank for n in g] for g in groups]
        return _BTPPending(buffers, widths, groups, full)

    def _reduce(self, p: _BTPPending, online: bool) -> Tuple[Tensors, Tensors]:
        """All-reduce the latents (one call per buffer), reduce-scatter full-rank outputs, and for
        Online RMSNorm divide everything by rms_global from the folded statistic."""
        reduced = [all_reduce_flat([b], self.tp_pg)[0] for b in p.buffers]
        rms_global = None
        if online:
            reduced[0], rms_global = unfold_statistic(reduced[0], self.norm.dim, self.norm.eps)
            reduced[1:] = [(t.float() / rms_global).to(t.dtype) for t in reduced[1:]]
        latents: Tensors = {}
        for buf, widths, names in zip(reduced, p.widths, p.names):
            latents.update(zip(names, buf.split(widths, dim=-1)))
        full: Tensors = {}
        if rms_global is not None and p.full:
            # each rank divides only its own output features by rms_global, so the gradient of the
            # replicated statistic from these consumers is partial: sum it (f: identity forward,
            # all-reduce backward). Needed only when a full-rank linear follows an online norm.
            rms_global = differentiable_identity(rms_global, self.tp_pg)
        for n, part in p.full.items():
            y = reduce_scatter_features(part, self.tp_pg)
            full[n] = y if rms_global is None else (y.float() / rms_global).to(y.dtype)
        return latents, full

    def _expand(self, names: Sequence[str], pure: Tensors) -> Tensors:
        """Column-parallel up factors on the replicated latents -> feature-sharded outputs."""
        fact = self._factorised(names)
        return dict(zip(fact, distinct_input_gemm(
            [self._mod(n).up for n in fact], [latent(self.kind, n, pure, self.previous) for n in fact],
            self.grouped, pre=lambda t: differentiable_identity(t, self.tp_pg),
        )))

    def _enter(self, x: torch.Tensor, s_global: Optional[torch.Tensor]) -> _BTPPending:
        if self.norm.mode == "online":
            x_hat, rms_local, s_local = self.norm.normalise_online(x)
            return self._partials(self.FIRST, x_hat, rms_local, s_local)
        return self._partials(self.FIRST, self.norm.normalise_sync(x, s_global))

    def _middle(self, pure: Tensors, full: Tensors) -> _BTPPending:
        """One whole BTP chunk between two all-reduces: up factors, core, next down factor."""
        outs = {**self._expand(self.FIRST, pure), **full}
        return self._partials((self.LAST,), self._core(outs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pure: Tensors = {"o": self.relay_in.take()} if self.relay_in is not None else {}
        s_global = self.norm.sync_statistic(x) if self.norm.mode == "sync" else None
        entered = maybe_checkpoint(self.checkpointing, self._enter, x, s_global)
        latents, full = self._reduce(entered, online=self.norm.mode == "online")
        pure.update(latents)
        chunk = maybe_checkpoint(self.checkpointing, self._middle, dict(pure), full)
        latents, full = self._reduce(chunk, online=False)
        pure.update(latents)
        if self.relay_out is not None:
            self.relay_out.put(pure[self.LAST])
        # the LAST up factor opens the next chunk; its output is this sub-layer's sharded branch
        return full[self.LAST] if self.LAST in full else self._expand((self.LAST,), pure)[self.LAST]


class BTPAttention(Attention, _BTPSublayer):
    """Each TP rank holds its own heads; one qk-norm weight serves every head (as in Megatron)."""


class BTPMLP(MLP, _BTPSublayer):
    pass
