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

Tensor parallelism: E and D are REPLICATED on every TP rank. Under Megatron TP the residual stream
and the MLP output are replicated, so every rank computes the same E/D forward on the same data and
gets the same full gradient in backward (the column-parallel input all-reduce makes the incoming
gradient identical on every rank): no extra collective, and the weights stay identical across TP.
They are tiny (2 m (d + h) per boundary) next to a block, so sharding them would buy nothing but a
collective on the wire's critical path. A strategy whose residual stream is sharded on d (BOOST's
btp) cannot feed them and is rejected.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder, from_wire, to_wire
from nanotron_ext.config.checks import ConfigError
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


class TwoLayer(nn.Module):
    """linear, nonlinearity, linear (no biases, as the paper's parameter count implies)."""

    def __init__(self, d_in: int, m: int, d_out: int, act: str, zero_last: bool,
                 norm: Optional[RMSNorm] = None) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(d_in, m, bias=False)
        self.fc2 = nn.Linear(m, d_out, bias=False)
        self.act = _ACTIVATIONS[act]
        if zero_last:
            mark_zero_init(self.fc2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.fc2(self.act(self.fc1(x)))


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


class ResBMCodec(BoundaryCodec):
    """One (E_l, D_{l+1}) pair per codec boundary, options from model.codec.resbm."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, strategy: TPStrategy) -> None:
        super().__init__(cfg, tp_pg)
        rc = cfg.codec.resbm
        self.h = rc.width(cfg.hidden_size)
        self.m = rc.hidden(cfg.hidden_size)
        if strategy.residual_sharded and tp_pg.size() > 1:
            raise ConfigError(f"model.codec.kind=resbm needs a replicated residual stream under TP; "
                              f"model.tp_strategy={cfg.tp_strategy!r} shards it on d")

    def encoder(self, boundary: int) -> BoundaryEncoder:
        return ResBMEncoder(self.cfg.hidden_size, self.h, self.m, self.cfg.codec.resbm, self.cfg.rms_norm_eps,
                            self.wire_dtype)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return ResBMDecoder(self.cfg.hidden_size, self.h, self.m, self.cfg.codec.resbm, self.cfg.rms_norm_eps)
