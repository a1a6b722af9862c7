"""TP strategies for low-rank Llamas (BOOST): "vanilla" and "btp" (bottleneck-aware TP).

vanilla: the residual stream is replicated and every factorised linear is one Megatron chunk: its
down factor (d -> r) column-parallel on r, its up factor (r -> out) row-parallel, an all-reduce on
[b, s, out] in the forward and one on the chunk input in the backward. Attention and SwiGLU run
replicated between the chunks (Table 6: 5bsd + 2bs*d_ff forward per block).

btp: the chunk is shifted by one factor: an up factor (r -> out) is column-parallel and the NEXT
down factor (in -> r) row-parallel, so the only collective of a chunk is the all-reduce of the
[b, s, r] latent (7bsr per block per pass). Every linear therefore maps feature-sharded input to
feature-sharded output: the residual stream stays sharded on d, attention runs on local heads,
SwiGLU on local d_ff, and the pre-norms sit inside chunks (online or sync, see
parallel/online_rmsnorm.py). A full-rank (untargeted) linear keeps that contract with a
row-parallel GEMM and a reduce-scatter of its output features.

Both strategies optionally group linears (model.boost.group_linears): first GEMMs that share an
input become one GEMM over concatenated weights, second GEMMs on distinct latents one torch.bmm per
set of equal weight shapes, and the collectives of a group become one call. With
model.boost.lowrank_checkpointing the collective-free part of every chunk runs under
torch.utils.checkpoint (non-reentrant), so only the chunk boundaries are kept and the re-forward
issues no collective. Under btp those boundaries are the r-wide latents (plus the d/tp residual
shard at each sub-layer input); under vanilla they are the replicated d-wide chunk outputs.

Parameters stay one pair of factors per linear (names independent of strategy and grouping, so
one checkpoint serves every layout); a grouped GEMM concatenates or stacks this rank's weight
slices on each call, a weight-sized copy next to an activation-sized GEMM.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import SplitConfig, mark_all_parameters_in_module_as_sharded
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import differentiable_identity
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelEmbedding
from torch import nn

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.layers import RMSNorm, RotaryEmbedding, causal_attention
from nanotron_ext.models.lowrank import (
    LatentRelay,
    LinearSpec,
    lax_previous,
    latent,
    linear_specs,
    maybe_checkpoint,
    warn_once,
)
from nanotron_ext.models.tp_strategy import MegatronHead, MegatronStrategy, TPStrategy, register_tp_strategy
from nanotron_ext.parallel.btp import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    all_reduce_flat,
    gather_features,
    reduce_scatter_features,
    split_features,
)
from nanotron_ext.parallel.online_rmsnorm import ShardedRMSNorm, fold_statistic, rescale_local, unfold_statistic

Tensors = Dict[str, torch.Tensor]


class LowRankPair(nn.Module):
    """The two factors of one factorised linear, each laid out by the TP strategy."""

    def __init__(self, down: nn.Module, up: nn.Module) -> None:
        super().__init__()
        self.down, self.up = down, up


# -- grouped GEMMs -------------------------------------------------------------------------------------
def shared_input_gemm(mods: Sequence[nn.Module], x: torch.Tensor, grouped: bool) -> List[torch.Tensor]:
    """`m.local(x)` for each module; grouped: ONE GEMM over the concatenated (local) weights."""
    if grouped and len(mods) > 1:
        y = F.linear(x, torch.cat([m.weight for m in mods]))
        return list(y.split([m.weight.shape[0] for m in mods], dim=-1))
    return [m.local(x) for m in mods]


def shape_groups(mods: Sequence[nn.Module]) -> List[List[int]]:
    """Indices of modules with equal weight shapes (the ones a batched GEMM can take together)."""
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for i, m in enumerate(mods):
        groups.setdefault(tuple(m.weight.shape), []).append(i)
    return list(groups.values())


def distinct_input_gemm(
    mods: Sequence[nn.Module], xs: Sequence[torch.Tensor], grouped: bool, pre: Callable[[torch.Tensor], torch.Tensor]
) -> List[torch.Tensor]:
    """`m.local(pre(x))` for each (module, input) pair; grouped: the inputs are stacked, `pre` runs
    once on the stack (one collective marker instead of one per input) and each set of equal weight
    shapes is one torch.bmm."""
    if not grouped or len(mods) <= 1:
        return [m.local(pre(x)) for m, x in zip(mods, xs)]
    stacked = pre(torch.stack(list(xs)))  # [k, *lead, in]
    lead = stacked.shape[1:-1]
    flat = stacked.flatten(1, -2)  # [k, N, in]
    outs: List[Optional[torch.Tensor]] = [None] * len(mods)
    for idx in shape_groups(mods):
        if len(idx) == 1:
            outs[idx[0]] = mods[idx[0]].local(stacked[idx[0]])
            continue
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        x = flat[idx[0]:idx[-1] + 1] if contiguous else flat[idx]
        y = torch.bmm(x, torch.stack([mods[i].weight for i in idx]).transpose(1, 2))
        for j, i in enumerate(idx):
            outs[i] = y[j].unflatten(0, lead)
    return outs  # type: ignore[return-value]


def _attend(mod: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the heads this rank holds; q/k/v: [b, s, heads * head_dim]."""
    b, s, hd = q.shape[0], q.shape[1], mod.head_dim
    q, k, v = q.reshape(b, s, mod.n_q, hd), k.reshape(b, s, mod.n_kv, hd), v.reshape(b, s, mod.n_kv, hd)
    if mod.q_norm is not None:
        q, k = mod.q_norm(q), mod.k_norm(k)
    out = causal_attention(mod.rotary(q), mod.rotary(k), v, mod.backend)
    return out.reshape(b, s, mod.n_q * hd)


def _init_attention(mod: nn.Module, cfg: ModelConfig, heads_divisor: int, qk_norm_group: Optional[dist.ProcessGroup]) -> None:
    mod.n_q, mod.n_kv, mod.head_dim = cfg.num_heads // heads_divisor, cfg.num_kv_heads // heads_divisor, cfg.head_dim
    mod.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, shared_across=qk_norm_group) if cfg.qk_norm else None
    mod.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, shared_across=qk_norm_group) if cfg.qk_norm else None
    mod.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    mod.backend = cfg.attention


class _Sublayer(nn.Module):
    """Pre-norm sub-layer: norm -> FIRST linears (shared input) -> core -> LAST linear.

    Attention: FIRST = q, k, v; core = RoPE + causal attention; LAST = o.
    MLP:       FIRST = gate, up; core = silu(gate) * up;      LAST = down.
    """

    FIRST: Tuple[str, ...] = ()
    LAST: str = ""

    def __init__(
        self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, relay_in: Optional[LatentRelay], relay_out: Optional[LatentRelay]
    ) -> None:
        super().__init__()
        self.tp_pg, self.kind = tp_pg, cfg.low_rank.kind
        self.specs = linear_specs(cfg)
        self.previous = lax_previous(self.specs, self.kind)
        self.grouped = cfg.boost.group_linears
        self.checkpointing = cfg.boost.lowrank_checkpointing
        self.relay_in, self.relay_out = relay_in, relay_out
        for name in (*self.FIRST, self.LAST):
            setattr(self, f"{name}_proj", self._build_linear(self.specs[name]))
        ups = [self._mod(n).up for n in self.FIRST if self.specs[n].factorised]
        if self.grouped and len(ups) > 1 and len(shape_groups(ups)) > 1:
            warn_once(f"group_linears: the up-projections of {'/'.join(self.FIRST)} differ in output width "
                      "(grouped-query attention); each width is batched separately")

    # strategy-specific
    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        raise NotImplementedError

    def _core(self, outs: Tensors) -> torch.Tensor:
        raise NotImplementedError

    # helpers
    def _mod(self, name: str) -> nn.Module:
        return getattr(self, f"{name}_proj")

    def _first_gemm(self, name: str) -> nn.Module:
        """The GEMM that reads a linear's input: its down factor, or the whole full-rank weight."""
        return self._mod(name).down if self.specs[name].factorised else self._mod(name)

    def _factorised(self, names: Sequence[str]) -> List[str]:
        return [n for n in names if self.specs[n].factorised]


# =====================================================================================================
# vanilla low-rank TP
# =====================================================================================================
class _VanillaPending(NamedTuple):
    partials: Tensors  # row-parallel partial sums, all-reduced next
    shards: Tensors  # column-parallel output shards of full-rank linears, gathered next
    done: Tensors  # outputs of replicated (unsharded) factorised linears
    latents: Tensors  # pure latents (down outputs) for LaX


class _VanillaSublayer(_Sublayer):
    """Replicated input -> replicated output; each factorised linear is its own Megatron chunk."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp_pg: dist.ProcessGroup,
        relay_in: Optional[LatentRelay] = None,
        relay_out: Optional[LatentRelay] = None,
    ) -> None:
        tp, r = tp_pg.size(), cfg.rank
        self.shard_rank = r % tp == 0
        if cfg.low_rank.kind != "none" and not self.shard_rank:
            warn_once(f"vanilla TP: rank {r} is not divisible by tp={tp}; factorised linears run unsharded "
                      "on every TP rank (correct, no TP collective, no memory saving)")
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        pg = self.tp_pg
        if not spec.factorised:
            return ColumnParallelLinear(spec.in_features, spec.out_features, pg)
        if self.shard_rank:
            return LowRankPair(ColumnParallelLinear(spec.in_features, spec.rank, pg), RowParallelLinear(spec.rank, spec.out_features, pg))
        return LowRankPair(ReplicatedLinear(spec.in_features, spec.rank), ReplicatedLinear(spec.rank, spec.out_features))

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


class VanillaAttention(_VanillaSublayer):
    FIRST, LAST = ("q", "k", "v"), "o"

    def __init__(
        self,
        cfg: ModelConfig,
        tp_pg: dist.ProcessGroup,
        relay_in: Optional[LatentRelay] = None,
        relay_out: Optional[LatentRelay] = None,
    ) -> None:
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        _init_attention(self, cfg, heads_divisor=1, qk_norm_group=None)  # every rank computes all heads

    def _core(self, outs: Tensors) -> torch.Tensor:
        return _attend(self, outs["q"], outs["k"], outs["v"])


class VanillaMLP(_VanillaSublayer):
    FIRST, LAST = ("gate", "up"), "down"

    def _core(self, outs: Tensors) -> torch.Tensor:
        return F.silu(outs["gate"]) * outs["up"]


# =====================================================================================================
# bottleneck-aware TP
# =====================================================================================================
class _BTPPending(NamedTuple):
    buffers: List[torch.Tensor]  # partial sums of down factors to all-reduce (the norm statistic folded into the first)
    widths: List[List[int]]  # latent widths inside each buffer
    names: List[List[str]]  # linear names inside each buffer
    full: Tensors  # partial sums of full-rank linears, reduce-scattered next


class _BTPSublayer(_Sublayer):
    """Feature-sharded input -> feature-sharded output; collectives only on r-wide latents."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp_pg: dist.ProcessGroup,
        relay_in: Optional[LatentRelay] = None,
        relay_out: Optional[LatentRelay] = None,
    ) -> None:
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

    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        pg = self.tp_pg
        if not spec.factorised:
            return RowParallelLinear(spec.in_features, spec.out_features, pg)
        return LowRankPair(RowParallelLinear(spec.in_features, spec.rank, pg), ColumnParallelLinear(spec.rank, spec.out_features, pg))

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
            buffers = [fold_statistic(buffers[0], rms_local, s_local)] + [rescale_local(b, rms_local) for b in buffers[1:]]
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


class BTPAttention(_BTPSublayer):
    FIRST, LAST = ("q", "k", "v"), "o"

    def __init__(
        self,
        cfg: ModelConfig,
        tp_pg: dist.ProcessGroup,
        relay_in: Optional[LatentRelay] = None,
        relay_out: Optional[LatentRelay] = None,
    ) -> None:
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        # one qk-norm weight serves every head and each rank holds different heads (as in Megatron)
        _init_attention(self, cfg, heads_divisor=tp_pg.size(), qk_norm_group=tp_pg)

    def _core(self, outs: Tensors) -> torch.Tensor:
        return _attend(self, outs["q"], outs["k"], outs["v"])


class BTPMLP(_BTPSublayer):
    FIRST, LAST = ("gate", "up"), "down"

    def _core(self, outs: Tensors) -> torch.Tensor:
        return F.silu(outs["gate"]) * outs["up"]


# -- embedding and head under btp -----------------------------------------------------------------------
class HiddenShardedEmbedding(nn.Embedding):
    """Token table sharded on the hidden dim: each rank looks up its own d/tp columns, no collective."""

    def __init__(self, num_embeddings: int, embedding_dim: int, pg: dist.ProcessGroup) -> None:
        if embedding_dim % pg.size():
            raise ValueError(f"btp shards the embedding width {embedding_dim} over tp={pg.size()}")
        super().__init__(num_embeddings, embedding_dim // pg.size())
        mark_all_parameters_in_module_as_sharded(self, pg=pg, split_config=SplitConfig(split_dim=1))


class FeatureShardedEmbedding(TensorParallelEmbedding):
    """nanotron's vocab-sharded embedding whose output keeps this rank's d/tp features; used when the
    table is tied to the vocab-sharded head (the two must share one layout)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return split_features(super().forward(input_ids), self.pg)


class GatheredHead(MegatronHead):
    """Megatron's head (final norm, vocab-sharded projection) after gathering the sharded residual."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__(cfg, tp_pg)
        self.tp_pg = tp_pg

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states=gather_features(hidden_states, self.tp_pg))


# -- strategies -------------------------------------------------------------------------------------------
class _LowRankStrategy(TPStrategy):
    attention_cls: type
    mlp_cls: type

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__(cfg, tp_pg)
        if cfg.low_rank.kind == "none":
            raise ValueError(f"tp_strategy {self.__class__.__name__} needs model.low_rank.kind in svd/cola/lax")
        specs = linear_specs(cfg)
        # LaX gate/up <- o crosses from the attention module to the MLP module of the same layer
        self._relay_needed = any(prev == "o" for prev in lax_previous(specs, cfg.low_rank.kind).values())
        self._relays: Dict[int, LatentRelay] = {}

    def attention(self, layer_idx: int) -> nn.Module:
        relay = self._relays.setdefault(layer_idx, LatentRelay()) if self._relay_needed else None
        return self.attention_cls(self.cfg, self.tp_pg, relay_out=relay)

    def mlp(self, layer_idx: int) -> nn.Module:
        relay = self._relays.pop(layer_idx, None) if self._relay_needed else None
        if self._relay_needed and relay is None:
            raise RuntimeError(f"LaX: build attention({layer_idx}) before mlp({layer_idx})")
        return self.mlp_cls(self.cfg, self.tp_pg, relay_in=relay)


@register_tp_strategy("vanilla")
class VanillaStrategy(_LowRankStrategy, MegatronStrategy):
    """Low-rank model, Megatron TP applied per factorised linear; embedding and head as Megatron."""

    attention_cls, mlp_cls = VanillaAttention, VanillaMLP


@register_tp_strategy("btp")
class BTPStrategy(_LowRankStrategy):
    """Bottleneck-aware TP: residual stream sharded on d between blocks and across pipeline stages."""

    residual_sharded = True
    attention_cls, mlp_cls = BTPAttention, BTPMLP

    def embedding(self) -> nn.Module:
        if self.cfg.tie_embeddings:
            return FeatureShardedEmbedding(self.cfg.vocab_size, self.cfg.hidden_size, pg=self.tp_pg,
                                           mode=TensorParallelLinearMode.ALL_REDUCE)
        return HiddenShardedEmbedding(self.cfg.vocab_size, self.cfg.hidden_size, self.tp_pg)

    def head(self) -> nn.Module:
        return GatheredHead(self.cfg, self.tp_pg)
