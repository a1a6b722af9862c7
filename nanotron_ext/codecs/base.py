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
sets `needs_token_ids` therefore gets the ids packed into the leading slots of its wire tensor
(`pack_ids` / `unpack_ids`): int32 bit-cast to the wire dtype, no gradient, counted as sent (their
zero gradient crosses back too: the gradient has the wire's shape).
Each boundary gets its own encoder and decoder modules, living on the sending and receiving
stage with any parameters they own.

Wire dtype. Values cross in the run's compute dtype (`wire_dtype`: bf16 under `model.dtype: bf16`, the
autocast run whose residual stream stays fp32; as the ResBM paper's appendix A.3 counts its transfers):
an encoder hands `to_wire(x, self.wire_dtype)` over, a decoder starts from `from_wire(wire)` (fp32, the
residual stream's dtype), so the gradient crosses back in the wire dtype too. Codecs that pack bits
(quantised codes, indices) use the wire dtype as a container and count bytes, not values. A model cast to
float64 (`.double()`: the tests' single-process reference of a composed model) stays float64 across its
boundaries: `to_wire`, `from_wire` and `residual_float` keep float64, and ids pack as int64.

Asymmetric wires. The gradient of the wire has the wire's shape, so a codec whose backward payload is
wider than its forward one (MAPL's RVQ: indices forward, a quantised gradient back) emits the wider
tensor and marks how many leading columns carry the forward payload (`mark_forward_columns`, from
nanotron_ext.parallel.p2p); the pipeline's P2P sends only those columns forward and the receiver pads the
rest with zeros, so each direction costs its own payload.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P
from torch import nn

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.parallel.p2p import forward_columns, mark_forward_columns


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
        self.wire_dtype = wire_dtype(cfg)

    def encoder(self, boundary: int) -> BoundaryEncoder:
        raise NotImplementedError

    def decoder(self, boundary: int) -> BoundaryDecoder:
        raise NotImplementedError

    def wire_replicated(self, residual_sharded: bool) -> bool:
        """Whether this codec's wire is the same on every TP rank (the pipeline then sends it once, as 1/tp
        slices: nanotron_ext.parallel.p2p) rather than sharded over TP (sent whole). By default the wire
        follows the residual stream (replicated under Megatron/vanilla, sharded under btp)."""
        return not residual_sharded

    def after_backward(
        self, encoders: Dict[int, BoundaryEncoder], decoders: Dict[int, BoundaryDecoder], p2p: P2P
    ) -> None:
        """Gradients of this rank's codec modules are complete (called before clipping and the DP sync).
        A codec whose encoder and decoder hold copies of one shared parameter combines their gradients
        here (across the pipeline boundary, through the pipeline's `p2p` on `p2p.pg`, when the two sides
        live on different stages: emulated links and the ledger see it)."""


def feature_shard(tp_pg: Optional[dist.ProcessGroup], d: int) -> slice:
    """This TP rank's features of a residual stream sharded on d over `tp_pg` (all of them for None): the
    contiguous block of d / tp that BOOST's btp and nanotron's column-parallel linears give rank r."""
    if tp_pg is None:
        return slice(None)
    width = d // tp_pg.size()
    rank = dist.get_rank(tp_pg)
    return slice(rank * width, (rank + 1) * width)


def wire_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype values cross a boundary in: the run's compute dtype (`model.dtype`)."""
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def to_wire(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A value wire in `dtype` (differentiable: the gradient comes back in `dtype` and leaves in x's); float64
    stays float64 (a float64 reference model)."""
    return x if x.dtype == torch.float64 else x.to(dtype)


def from_wire(wire: torch.Tensor) -> torch.Tensor:
    """A received value wire as fp32, the dtype of the residual stream (fp32 master weights)."""
    return residual_float(wire)


def residual_float(x: torch.Tensor) -> torch.Tensor:
    """`x` in the residual stream's dtype: fp32, or float64 in a float64 reference model."""
    return x if x.dtype == torch.float64 else x.float()


def _id_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type ids travel as in a `dtype` wire: int32, or int64 in a float64 wire (one column)."""
    return torch.int64 if dtype.itemsize == 8 else torch.int32


def _id_slots(dtype: torch.dtype) -> int:
    """Wire columns one id occupies when bit-cast to `dtype`."""
    size, id_size = dtype.itemsize, _id_dtype(dtype).itemsize
    if id_size % size:
        raise ValueError(f"cannot pack int32 token ids into a {dtype} wire")
    return id_size // size


def pack_ids(wire: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Prepend `input_ids` [b, s] to `wire` [b, s, w] as bit-cast int32 columns (bit-exact, no gradient);
    a forward-column mark of `wire` moves to the packed tensor (ids included)."""
    ids = input_ids.to(_id_dtype(wire.dtype)).unsqueeze(-1).contiguous().view(wire.dtype)
    packed = torch.cat([ids, wire], dim=-1)
    columns = forward_columns(wire)
    return packed if columns is None else mark_forward_columns(packed, ids.shape[-1] + columns)


def unpack_ids(packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_ids`: (wire, input_ids as int64)."""
    slots = _id_slots(packed.dtype)
    ids = packed[..., :slots].detach().contiguous().view(_id_dtype(packed.dtype)).squeeze(-1).long()
    return packed[..., slots:], ids
