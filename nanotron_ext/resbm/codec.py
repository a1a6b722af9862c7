"""The ResBM boundary codec (arXiv:2604.11947, sec. 3.2-3.3, fig. C.1).

Sending block l (encoder E_l = linear, nonlinearity, linear: d -> m -> h):
    b_l = trunc_h(x_attn_l) + E_l(FF(norm(x_attn_l)))          (only b_l, h wide, crosses the link)
Receiving block l+1 (decoder D_{l+1} = linear, nonlinearity, linear: h -> m -> d):
    x_attn_{l+1} = pad_d(b_l) + Attn(norm(D_{l+1}(b_l)))

In the core's codec interface (nanotron_ext/codecs/base.py) the encoder gets residual = x_attn and
branch = FF(norm(x_attn)) and returns b; the decoder returns (pad_d(b), D(b)).

Wire dtype: b crosses in the run's compute dtype (appendix A.3: bf16, 2 B per value, 1 x 1024 x 32 =
64 KiB per boundary and micro-batch at 128x), its gradient too: under `model.dtype: bf16` (autocast over
fp32 weights) trunc_h(x_attn) is fp32 and would otherwise put 4 B per value on the link both ways. The
receiver continues its residual stream in fp32 from the bf16 values.

Tensor parallelism, replicated residual stream (Megatron, vanilla): E and D are REPLICATED on every TP
rank. Every rank computes the same E/D forward on the same data and gets the same full gradient in backward
(the column-parallel input all-reduce makes the incoming gradient identical on every rank): no extra
collective, and the weights stay identical across TP. They are tiny (2 m (d + h) per boundary) next to a
block, so sharding them would buy nothing but a collective on the wire's critical path.

Tensor parallelism, residual stream sharded on d (BOOST's btp, "BOOST: Bottleneck-Optimized Scalable
Training Framework for Low-Rank Large Language Models", arXiv:2512.12131): rank r holds the features S_r
(d / tp contiguous ones) of x_attn and of the MLP branch f = FF(norm(x_attn)). No d-wide activation is
gathered. With E = W2 act(W1 .) and the optional encoder RMSNorm n(f) = f * g / rms(f),
rms(f) = sqrt(sum_j f_j^2 / d + eps), every d-wide reduction is a sum over the shards:
    trunc_h(x)    = sum_r trunc_h(x)|_r          (rank r's features below h in place, zeros elsewhere:
                                                  the first h features live in the first shard(s))
    W1 n(f)       = (sum_r W1[:, S_r] (f_{S_r} * g_{S_r})) / rms(f)      (1 / rms(f) is per token: it
    sum_j f_j^2   = sum_r sum_{j in S_r} f_j^2                            commutes with the linear)
so each rank concatenates its three partial sums, [trunc_h(x)|_r, W1[:, S_r] (f g)_{S_r}, |f_{S_r}|^2]
(h + m + 1 wide; h + m without the norm; fp32), and ONE all-reduce in the TP group completes them (the
statistic rides in the same buffer, as in BOOST's Online RMSNorm, Alg. 1). W1 is row-parallel (and g
sharded) over d; act and W2 (m -> h) are replicated. b is then the same on every TP rank: the pipeline sends
it once (`wire_replicated`), and bytes per boundary do not depend on tp. Backward: the all-reduce's adjoint
is the identity (its consumers are replicated, so each rank's partial sums get the whole gradient).
The decoder D = W2' act(W1' n'(.)) has h -> m replicated (and its RMSNorm on h) and m -> d column-parallel:
rank r emits D(b)_{S_r} = W2'[S_r, :] a and pad_d(b)_{S_r} (b's features in S_r below h, zeros above), no
forward collective. Backward, both uses of replicated values, b (through pad) and a = act(W1' n'(b))
(through W2'[S_r, :]), get only rank r's part of their gradient: one all-reduce of the (h + m)-wide
[db_pad, da] sums them (nanotron's differentiable_identity on the concatenation), after which W1', n' and
the wire's gradient are the same on every rank. Per boundary and micro-batch the TP group (fast, inside a
node) carries mbs * seq * (h + m [+ 1]) * 4 bytes each way; the pipeline link carries mbs * seq * h values
as at tp = 1. W1, g and W2' are nanotron sharded parameters (checkpoints, clipping, Muon see ShardedInfo);
the parameter names are the replicated codec's, so both start from the same weights.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import SplitConfig, mark_all_parameters_in_module_as_sharded
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_all_reduce_sum,
    differentiable_identity,
)
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear, TensorParallelRowLinear
from torch import nn

from nanotron_ext.codecs.base import (
    BoundaryCodec,
    BoundaryDecoder,
    BoundaryEncoder,
    feature_shard,
    from_wire,
    to_wire,
)
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.init import mark_zero_init
from nanotron_ext.models.layers import RMSNorm
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.resbm.config import ResBMConfig

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "identity": lambda x: x}


def trunc(x: torch.Tensor, h: int) -> torch.Tensor:
    """trunc_h(x) = x I_{d x h} (eq. 4-5 with c > C): the first h coordinates."""
    return x[..., :h]


def pad(b: torch.Tensor, d: int) -> torch.Tensor:
    """pad_d(b) = b I_{h x d} (eq. 4-5 with c < C): b followed by d - h zero columns."""
    return F.pad(b, (0, d - b.shape[-1]))


def trunc_shard(x: torch.Tensor, h: int, mine: slice) -> torch.Tensor:
    """This shard's term of trunc_h(x) (h wide): x holds the features `mine`; those below h go in place."""
    start = min(mine.start, h)
    n = max(0, min(h, mine.stop) - start)
    return F.pad(x[..., :n], (start, h - start - n))  # n = 0 still links x to the graph (a zero gradient)


def pad_shard(b: torch.Tensor, mine: slice) -> torch.Tensor:
    """The features `mine` of pad_d(b): b's features in that range, zeros beyond h."""
    part = b[..., mine.start:min(mine.stop, b.shape[-1])]
    return F.pad(part, (0, mine.stop - mine.start - part.shape[-1]))


class TwoLayer(nn.Module):
    """linear, nonlinearity, linear (no biases, as the paper's parameter count implies). The sharded codec
    passes its own (nanotron TP) linears and norm so the parameter names stay the same."""

    def __init__(self, d_in: int, m: int, d_out: int, act: str, zero_last: bool, norm: Optional[nn.Module] = None,
                 fc1: Optional[nn.Linear] = None, fc2: Optional[nn.Linear] = None) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = fc1 if fc1 is not None else nn.Linear(d_in, m, bias=False)
        self.fc2 = fc2 if fc2 is not None else nn.Linear(m, d_out, bias=False)
        self.act = _ACTIVATIONS[act]
        if zero_last:
            mark_zero_init(self.fc2.weight)  # after nanotron re-created a sharded parameter (it drops marks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.fc2(self.act(self.fc1(x)))


class ShardedGain(nn.Module):
    """The gain g of an RMSNorm on d, sharded on d like the residual stream (normalised by ShardedResBMEncoder)."""

    def __init__(self, d: int, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d // tp_pg.size()))
        mark_all_parameters_in_module_as_sharded(self, pg=tp_pg, split_config=SplitConfig(split_dim=0))


class ResBMEncoder(BoundaryEncoder):
    def __init__(self, d: int, h: int, m: int, rc: ResBMConfig, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.dtype = h, dtype
        norm = RMSNorm(d, eps) if rc.norm in ("encoder", "both") else None
        self.net = TwoLayer(d, m, h, rc.nonlinearity, rc.zero_init_encoder, norm)

    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        return to_wire(trunc(residual, self.h) + self.net(branch), self.dtype)


class ResBMDecoder(BoundaryDecoder):
    def __init__(self, d: int, h: int, m: int, rc: ResBMConfig, eps: float) -> None:
        super().__init__()
        self.d = d
        norm = RMSNorm(h, eps) if rc.norm in ("decoder", "both") else None
        self.net = TwoLayer(h, m, d, rc.nonlinearity, rc.zero_init_decoder, norm)

    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        b = from_wire(wire)
        return pad(b, self.d), self.net(b)


class ShardedResBMEncoder(BoundaryEncoder):
    """E on a residual stream sharded on d over `tp_pg`: one (h + m [+ 1])-wide all-reduce (module docstring)."""

    def __init__(self, d: int, h: int, m: int, rc: ResBMConfig, eps: float, dtype: torch.dtype,
                 tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.d, self.h, self.m, self.eps, self.dtype, self.tp_pg = d, h, m, eps, dtype, tp_pg
        norm = ShardedGain(d, tp_pg) if rc.norm in ("encoder", "both") else None
        fc1 = TensorParallelRowLinear(d, m, pg=tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE, bias=False)
        self.net = TwoLayer(d, m, h, rc.nonlinearity, rc.zero_init_encoder, norm, fc1=fc1)

    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        mine = feature_shard(self.tp_pg, self.d)
        f = branch if self.net.norm is None else branch.float() * self.net.norm.weight.float()
        parts = [trunc_shard(residual, self.h, mine).float(), F.linear(f, self.net.fc1.weight).float()]
        if self.net.norm is not None:
            parts.append(branch.float().pow(2).sum(-1, keepdim=True))  # this shard's sum of squares
        summed = differentiable_all_reduce_sum(torch.cat(parts, dim=-1), group=self.tp_pg)  # the only collective
        t, a = summed[..., :self.h], summed[..., self.h:self.h + self.m]
        if self.net.norm is not None:
            a = a * torch.rsqrt(summed[..., -1:] / self.d + self.eps)
        return to_wire(t + self.net.fc2(self.net.act(a)), self.dtype)


class ShardedResBMDecoder(BoundaryDecoder):
    """D onto a residual stream sharded on d over `tp_pg`: m -> d column-parallel, one backward all-reduce."""

    def __init__(self, d: int, h: int, m: int, rc: ResBMConfig, eps: float, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.d, self.h, self.tp_pg = d, h, tp_pg
        norm = RMSNorm(h, eps) if rc.norm in ("decoder", "both") else None
        fc2 = TensorParallelColumnLinear(m, d, pg=tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE, bias=False)
        self.net = TwoLayer(h, m, d, rc.nonlinearity, rc.zero_init_decoder, norm, fc2=fc2)

    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        b = from_wire(wire)
        x = b if self.net.norm is None else self.net.norm(b)
        a = self.net.act(self.net.fc1(x))
        # both replicated values feed this rank's shard only: their gradients are summed over TP in ONE all-reduce
        both = differentiable_identity(torch.cat([b, a.float()], dim=-1), group=self.tp_pg)
        b, a = both[..., :self.h], both[..., self.h:]
        return pad_shard(b, feature_shard(self.tp_pg, self.d)), F.linear(a, self.net.fc2.weight)


class ResBMCodec(BoundaryCodec):
    """One (E_l, D_{l+1}) pair per codec boundary, options from model.codec.resbm; sharded on a residual stream
    that the TP strategy shards (btp at tp > 1)."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, strategy: TPStrategy) -> None:
        super().__init__(cfg, tp_pg)
        rc = cfg.codec.resbm
        self.h = rc.width(cfg.hidden_size)
        self.m = rc.hidden(cfg.hidden_size)
        self.sharded_pg = tp_pg if strategy.residual_sharded and tp_pg.size() > 1 else None

    def wire_replicated(self, residual_sharded: bool) -> bool:
        return True  # b is all-reduced over TP on a sharded stream, and computed alike on a replicated one

    def encoder(self, boundary: int) -> BoundaryEncoder:
        c = self.cfg
        if self.sharded_pg is not None:
            return ShardedResBMEncoder(c.hidden_size, self.h, self.m, c.codec.resbm, c.rms_norm_eps, self.wire_dtype,
                                       self.sharded_pg)
        return ResBMEncoder(c.hidden_size, self.h, self.m, c.codec.resbm, c.rms_norm_eps, self.wire_dtype)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        c = self.cfg
        if self.sharded_pg is not None:
            return ShardedResBMDecoder(c.hidden_size, self.h, self.m, c.codec.resbm, c.rms_norm_eps, self.sharded_pg)
        return ResBMDecoder(c.hidden_size, self.h, self.m, c.codec.resbm, c.rms_norm_eps)
