"""Vanilla low-rank TP: each factorised linear is its own Megatron chunk (BOOST sec. 3, Table 6:
5bsd + 2bs*d_ff forward per block)."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_identity,
)
from torch import nn

from nanotron_ext.boost.btp import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    all_reduce_flat,
    gather_features,
)
from nanotron_ext.boost.lowrank import (
    LatentRelay,
    LinearSpec,
    latent,
    maybe_checkpoint,
    warn_once,
)
from nanotron_ext.boost.sublayer import (
    MLP,
    Attention,
    LowRankPair,
    Sublayer,
    Tensors,
    distinct_input_gemm,
    shared_input_gemm,
)
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.layers import RMSNorm


# =====================================================================================================
# vanilla low-rank TP
# =====================================================================================================
class _VanillaPending(NamedTuple):
    partials: Tensors  # row-parallel partial sums, all-reduced next
    shards: Tensors  # column-parallel output shards of full-rank linears, gathered next
    done: Tensors  # outputs of replicated (unsharded) factorised linears
    latents: Tensors  # pure latents (down outputs) for LaX


class _VanillaSublayer(Sublayer):
    """Replicated input -> replicated output; each factorised linear is its own Megatron chunk."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, relay_in: Optional[LatentRelay] = None,
                 relay_out: Optional[LatentRelay] = None) -> None:
        tp, r = tp_pg.size(), cfg.low_rank.width(cfg.hidden_size)
        self.shard_rank = r % tp == 0
        if cfg.low_rank.kind != "none" and not self.shard_rank:
            warn_once(f"vanilla TP: rank {r} is not divisible by tp={tp}; factorised linears run unsharded "
                      "on every TP rank (correct, no TP collective, no memory saving)")
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _head_layout(self) -> Tuple[int, Optional[dist.ProcessGroup]]:
        return 1, None  # every rank computes all heads

    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        pg = self.tp_pg
        if not spec.factorised:
            return ColumnParallelLinear(spec.in_features, spec.out_features, pg)
        if self.shard_rank:
            return LowRankPair(ColumnParallelLinear(spec.in_features, spec.rank, pg),
                               RowParallelLinear(spec.rank, spec.out_features, pg), self._exact_product(spec.name))
        return LowRankPair(ReplicatedLinear(spec.in_features, spec.rank),
                           ReplicatedLinear(spec.rank, spec.out_features),
                           self._exact_product(spec.name))

    def _sharded(self, name: str) -> bool:
        return not self.specs[name].factorised or self.shard_rank

    def _local(self, names: Sequence[str], x: torch.Tensor, pure: Tensors) -> _VanillaPending:
        """Everything of the chunks reading `x` up to their collectives (nothing here communicates)."""
        sharded = [n for n in names if self._sharded(n)]
        replicated = [n for n in names if not self._sharded(n)]
        first: Tensors = {}
        if sharded:
            mods = [self._first_gemm(n) for n in sharded]
            if self.grouped:  # one f (backward all-reduce of the shared input) for the whole group
                first.update(zip(sharded, shared_input_gemm(mods, differentiable_identity(x, self.tp_pg), True)))
            else:  # each linear its own chunk: its own f
                first.update((n, m.local(differentiable_identity(x, self.tp_pg))) for n, m in zip(sharded, mods))
        if replicated:
            first.update(zip(replicated, shared_input_gemm([self._first_gemm(n) for n in replicated], x, self.grouped)))
        fact = self._factorised(names)
        lat = {n: first[n] for n in fact}
        seen = {**pure, **lat}
        second = dict(zip(fact, distinct_input_gemm(
            [self._mod(n).up for n in fact], [latent(self.kind, n, seen, self.previous) for n in fact],
            self.grouped, pre=lambda t: t,
        )))
        return _VanillaPending(
            partials={n: second[n] for n in fact if self.shard_rank},
            shards={n: first[n] for n in names if not self.specs[n].factorised},
            done={n: second[n] for n in fact if not self.shard_rank},
            latents=lat,
        )

    def _reduce(self, p: _VanillaPending) -> Tensors:
        out = dict(p.done)
        names = list(p.partials)
        if self.grouped:
            out.update(zip(names, all_reduce_flat([p.partials[n] for n in names], self.tp_pg)))
        else:
            out.update((n, all_reduce_flat([p.partials[n]], self.tp_pg)[0]) for n in names)
        out.update((n, gather_features(s, self.tp_pg)) for n, s in p.shards.items())
        return out

    def _enter(self, x: torch.Tensor, pure: Tensors) -> _VanillaPending:
        return self._local(self.FIRST, self.norm(x), pure)

    def _middle(self, outs: Tensors, pure: Tensors) -> _VanillaPending:
        return self._local((self.LAST,), self._core(outs), pure)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pure: Tensors = {"o": self.relay_in.take()} if self.relay_in is not None else {}
        first = maybe_checkpoint(self.checkpointing, self._enter, x, dict(pure))
        pure.update(first.latents)
        last = maybe_checkpoint(self.checkpointing, self._middle, self._reduce(first), dict(pure))
        if self.relay_out is not None:
            self.relay_out.put(last.latents[self.LAST])
        return self._reduce(last)[self.LAST]


class VanillaAttention(Attention, _VanillaSublayer):
    """Every TP rank computes all heads."""


class VanillaMLP(MLP, _VanillaSublayer):
    pass


# =====================================================================================================
