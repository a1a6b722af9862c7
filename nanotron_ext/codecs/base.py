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
residual + branch onto k coordinates and need the token ids on both sides.

Exactly one tensor crosses a boundary per micro-batch: nanotron's pipeline engines run one
communication at a time and deadlock in 1F1B's steady state when a stage sends two (the sender
blocks sending the second while the receiver blocks sending the previous gradient). A codec that
sets `needs_token_ids` therefore gets the ids packed into trailing slots of its wire tensor
(`pack_ids` / `unpack_ids`): int32 bit-cast to the wire dtype, no gradient, counted as sent.
Each boundary gets its own encoder and decoder modules, living on the sending and receiving
stage with any parameters they own.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import ModelConfig


class BoundaryEncoder(nn.Module):
    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The wire tensor [b, s, width] for the next stage."""
        raise NotImplementedError


class BoundaryDecoder(nn.Module):
    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(residual, hidden): what the receiving layer adds its attention to, and what it normalises."""
        raise NotImplementedError


class BoundaryCodec:
    needs_token_ids: bool = False
    """The encoder and decoder need the token ids (they then cross each boundary inside the wire)."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg = cfg
        self.tp_pg = tp_pg

    def encoder(self, boundary: int) -> BoundaryEncoder:
        raise NotImplementedError

    def decoder(self, boundary: int) -> BoundaryDecoder:
        raise NotImplementedError

    def after_backward(
        self, encoders: Dict[int, BoundaryEncoder], decoders: Dict[int, BoundaryDecoder], pp_pg: dist.ProcessGroup
    ) -> None:
        """Gradients of this rank's codec modules are complete (called before clipping and the DP sync).
        A codec whose encoder and decoder hold copies of one shared parameter combines their gradients
        here (across the pipeline boundary when the two sides live on different stages)."""


def _id_slots(dtype: torch.dtype) -> int:
    """Wire columns one int32 id occupies when bit-cast to `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    if 4 % size:
        raise ValueError(f"cannot pack int32 token ids into a {dtype} wire")
    return 4 // size


def pack_ids(wire: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Append `input_ids` [b, s] to `wire` [b, s, w] as bit-cast int32 columns (bit-exact, no gradient)."""
    ids = input_ids.to(torch.int32).unsqueeze(-1).contiguous().view(wire.dtype)
    return torch.cat([wire, ids], dim=-1)


def unpack_ids(packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_ids`: (wire, input_ids as int64)."""
    slots = _id_slots(packed.dtype)
    ids = packed[..., -slots:].detach().contiguous().view(torch.int32).squeeze(-1).long()
    return packed[..., :-slots], ids
