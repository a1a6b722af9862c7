"""The pipeline-boundary codec interface.

A boundary sits between the last decoder layer of stage p and the first of stage p+1. The
sending layer hands its encoder the two halves of its last residual update, and the receiving
layer asks its decoder for the two inputs of its attention sub-layer:

    sender   (stage p):    x_attn = residual after attention, branch = FF(norm(x_attn))
                           wire   = encoder(residual=x_attn, branch=branch, input_ids=ids)
    receiver (stage p+1):  residual, hidden = decoder(wire, input_ids=ids)
                           x_attn = residual + Attn(norm(hidden))

The identity codec sends residual + branch and returns it twice. ResBM sends
trunc_h(x_attn) + E(branch) and rebuilds (pad_d(b), D(b)); subspace/MAPL codecs project
residual + branch onto k coordinates and need the token ids on both sides. A codec that sets
`needs_token_ids` makes every decoder layer carry `input_ids`, so the ids cross each boundary
(and are counted) next to the wire tensors. Each boundary gets its own encoder and decoder
modules; they live on the sending and receiving stage and own any parameters they have.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Type

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import ModelConfig

CODECS: Dict[str, Type["BoundaryCodec"]] = {}


def register_codec(name: str) -> Callable[[Type["BoundaryCodec"]], Type["BoundaryCodec"]]:
    def deco(cls: Type["BoundaryCodec"]) -> Type["BoundaryCodec"]:
        CODECS[name] = cls
        return cls

    return deco


class BoundaryEncoder(nn.Module):
    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError


class BoundaryDecoder(nn.Module):
    def forward(self, wire: Dict[str, torch.Tensor], input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class BoundaryCodec:
    needs_token_ids: bool = False
    wire_keys: Tuple[str, ...] = ("hidden_states",)
    """Names of the tensors the encoder emits; they are what crosses the link."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg = cfg
        self.tp_pg = tp_pg

    def encoder(self, boundary: int) -> BoundaryEncoder:
        raise NotImplementedError

    def decoder(self, boundary: int) -> BoundaryDecoder:
        raise NotImplementedError


def get_codec(cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> BoundaryCodec:
    name = cfg.codec.kind
    if name not in CODECS:
        raise ValueError(f"model.codec.kind={name!r} is not available; registered: {sorted(CODECS)}")
    return CODECS[name](cfg, tp_pg)
