"""The shared machinery of BOOST's low-rank sub-layers (attention and SwiGLU MLP): factor pairs,
grouped GEMMs, and the one Attention and MLP whose TP layout and chunk loop vanilla.py (vanilla TP of the
low-rank layers) and btp_sublayers.py (bottleneck-aware TP) specialise."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.boost.lowrank import (
    LatentRelay,
    LinearSpec,
    lax_previous,
    linear_specs,
    warn_once,
)
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.dense import FullTensor, NoDenseEquivalent
from nanotron_ext.models.init import full_shape, local_shard
from nanotron_ext.models.layers import RMSNorm, RotaryEmbedding, causal_attention

Tensors = Dict[str, torch.Tensor]

class LowRankPair(nn.Module):
    """The two factors of one factorised linear, each laid out by the TP strategy. `exact_product`: the linear
    computes up(down(x)) exactly (SVD; a LaX linear without a crossing); CoLA's silu and LaX's added latent
    of another linear do not.

    As a nanotron_ext.models.dense.DenseEquivalent: its dense weight is up @ down (export) and a dense weight W
    becomes the balanced factors of its rank-r truncated SVD, up = U_r S_r^1/2, down = S_r^1/2 V_r^T (import,
    the Eckart-Young optimum of ||W - up @ down||)."""

    def __init__(self, down: nn.Module, up: nn.Module, exact_product: bool) -> None:
        super().__init__()
        self.down, self.up = down, up
        self.exact_product = exact_product

    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        if exact and not self.exact_product:
            raise NoDenseEquivalent("model.low_rank.kind is cola or lax: y = up(h(down(x))) with a "
                                    "nonlinearity or another linear's latent in h has no single dense weight")
        # a factor whose weight is computed from other parameters (Subspace Models' W = U_S C under btp) states
        # its unsharded value itself: full() knows the shards of parameters only
        up, down = (f.full_weight(full) if hasattr(f, "full_weight") else full(f.weight) for f in (self.up, self.down))
        up, down = up.double(), down.double()
        return {"weight": (up @ down).float()}

    @torch.no_grad()
    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        w = dense["weight"].double()
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        r = full_shape(self.down.weight)[0]
        # fix each singular pair's sign (largest |entry| of u positive): every TP rank must cut the same factors
        sign = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True))).squeeze(0)
        sign[sign == 0] = 1
        u, vh = u * sign, vh * sign[:, None]
        root = s[:r].sqrt()
        factors = {"up": u[:, :r] * root, "down": root[:, None] * vh[:r]}
        for name, value in factors.items():
            param = getattr(self, name).weight
            param.copy_(local_shard(value.float(), param).to(param.dtype))
        dropped = s[r:].pow(2).sum().sqrt() / s.pow(2).sum().sqrt().clamp_min(1e-30)
        return {"weight": float(dropped)}


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


class Sublayer(nn.Module):
    """Pre-norm sub-layer: norm -> FIRST linears (shared input) -> core -> LAST linear.

    Attention: FIRST = q, k, v; core = RoPE + causal attention; LAST = o.
    MLP:       FIRST = gate, up; core = silu(gate) * up;      LAST = down.
    """

    FIRST: Tuple[str, ...] = ()
    LAST: str = ""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, relay_in: Optional[LatentRelay] = None,
                 relay_out: Optional[LatentRelay] = None) -> None:
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

    # where the two TP schemes differ (vanilla.py, btp_sublayers.py)
    def _build_linear(self, spec: LinearSpec) -> nn.Module:
        raise NotImplementedError

    def _head_layout(self) -> Tuple[int, Optional[dist.ProcessGroup]]:
        """(how many TP ranks the attention heads are split over, the group one qk-norm weight is shared across)."""
        raise NotImplementedError

    # where attention and the MLP differ (Attention, MLP below)
    def _core(self, outs: Tensors) -> torch.Tensor:
        raise NotImplementedError

    # helpers
    def _mod(self, name: str) -> nn.Module:
        return getattr(self, f"{name}_proj")

    def _exact_product(self, name: str) -> bool:
        """Whether up(down(x)) is linear `name`'s whole function: SVD, or LaX where no latent crosses into it."""
        return self.kind == "svd" or (self.kind == "lax" and name not in self.previous)

    def _first_gemm(self, name: str) -> nn.Module:
        """The GEMM that reads a linear's input: its down factor, or the whole full-rank weight."""
        return self._mod(name).down if self.specs[name].factorised else self._mod(name)

    def _factorised(self, names: Sequence[str]) -> List[str]:
        return [n for n in names if self.specs[n].factorised]


class Attention(Sublayer):
    """q, k, v -> RoPE + causal attention over the heads this rank holds -> o."""

    FIRST, LAST = ("q", "k", "v"), "o"

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, relay_in: Optional[LatentRelay] = None,
                 relay_out: Optional[LatentRelay] = None) -> None:
        super().__init__(cfg, tp_pg, relay_in, relay_out)
        heads_divisor, qk_norm_group = self._head_layout()
        self.n_q, self.n_kv = cfg.num_heads // heads_divisor, cfg.num_kv_heads // heads_divisor
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, shared_across=qk_norm_group) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, shared_across=qk_norm_group) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.backend = cfg.attention

    def _core(self, outs: Tensors) -> torch.Tensor:
        """Causal attention; q/k/v: [b, s, heads * head_dim] of this rank's heads."""
        q, k, v = outs["q"], outs["k"], outs["v"]
        b, s, hd = q.shape[0], q.shape[1], self.head_dim
        q, k, v = q.reshape(b, s, self.n_q, hd), k.reshape(b, s, self.n_kv, hd), v.reshape(b, s, self.n_kv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = causal_attention(self.rotary(q), self.rotary(k), v, self.backend)
        return out.reshape(b, s, self.n_q * hd)


class MLP(Sublayer):
    """gate, up -> silu(gate) * up -> down (SwiGLU)."""

    FIRST, LAST = ("gate", "up"), "down"

    def _core(self, outs: Tensors) -> torch.Tensor:
        return F.silu(outs["gate"]) * outs["up"]
