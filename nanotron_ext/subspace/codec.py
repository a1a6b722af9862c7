"""The Subspace Models codec (sec. 4.3, 4.4): a boundary sends Z = (X - T_fixed[ids]) U, k wide, plus the
token ids; the receiver rebuilds X = Z U^T + T_fixed[ids]. Exact when everything the sending stage wrote
into the residual stream lies in span(U) (the split embedding's T_S U^T and the constrained output
projections). Backward, autograd through the two products sends the receiver's gradient G as G U (the
wire's width) and the sender sees G U U^T (eq. 9-10).

Z crosses in the run's compute dtype (codecs/base.wire_dtype: bf16 under model.dtype bf16) and the ids ride
in the wire (codecs/base.pack_ids): forward bytes per boundary and micro-batch are
mbs * seq * (k * element_size + 4); the gradient of the packed wire has the same width (its id column
is zero), so backward bytes are the same as forward (measured: tests/test_subspace_parity.py,
tests/test_codec.py).

On a residual stream sharded over TP (BOOST's btp: rank r holds features S_r, d/tp of them), the codec
needs no all-gather of d-wide activations, because Z is a sum over feature shards:
    Z = (X - T_fixed[ids]) U = sum_r (X_{S_r} - T_fixed[ids]_{S_r}) U_{S_r}     (U_{S_r}: the rows S_r of U)
so each rank multiplies its shard by its rows of U (a row-parallel product) and ONE all-reduce of the
k-wide partial Z in the TP group completes it (backward: identity, each rank's dZ is the whole dZ). The
wire Z is then the same on every TP rank (the pipeline sends it once: wire_replicated). The decoder is
column-parallel: X_{S_r} = Z U_{S_r}^T + T_fixed[ids]_{S_r}, no forward communication; backward,
dZ = sum_r dX_{S_r} U_{S_r}, one all-reduce of the k-wide dZ (nanotron's differentiable_identity).
The split embedding (embedding.py) and the span(U) constraint (constraints.py) are built per feature shard
the same way, so model.codec.kind=subspace runs with model.tp_strategy=btp at any tp (Grassmann updates
excepted: below, and refused at config load by technique.SubspaceTechnique.check).

Every decoder also records A += G^T G of the gradient it receives (before projection: the full gradient
of the receiving stage) when Grassmann updates are on; the update uses the last boundary's A
(nanotron_ext.subspace.grassmann).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_all_reduce_sum,
    differentiable_identity,
)

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder, feature_shard, from_wire, to_wire
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.dense import FullTensor, NoDenseEquivalent
from nanotron_ext.subspace.basis import SubspaceHub


class _ExactBoundary:
    """nanotron_ext.models.dense.DenseEquivalent: the boundary rebuilds X exactly (the identity of a standard
    model) while the output projections stay in span(U): always under `reparam`, under `projection` only with
    re-projection after every step."""

    hub: SubspaceHub

    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        sub = self.hub.cfg.subspace
        if exact and sub.parameterisation == "projection" and not sub.reproject:
            raise NoDenseEquivalent("model.subspace.reproject=false: the output projections drift "
                                    "out of span(U), so the subspace codec drops part of what crosses each boundary")
        return {}

    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        return {}


class SubspaceEncoder(_ExactBoundary, BoundaryEncoder):
    """`sharded_pg`: the TP group the residual stream is sharded over (None: replicated); see module docstring."""

    def __init__(self, hub: SubspaceHub, dtype: torch.dtype, sharded_pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.hub, self.dtype, self.sharded_pg = hub, dtype, sharded_pg

    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        x = residual + branch
        mine = feature_shard(self.sharded_pg, self.hub.basis.shape[0])
        z = (x - self.hub.fixed[input_ids][..., mine].to(x.dtype)) @ self.hub.basis[mine].to(x.dtype)
        if self.sharded_pg is not None:
            z = differentiable_all_reduce_sum(z, group=self.sharded_pg)  # sum over the feature shards
        return to_wire(z, self.dtype)


class SubspaceDecoder(_ExactBoundary, BoundaryDecoder):
    def __init__(self, hub: SubspaceHub, boundary: int, accumulate: bool,
                 sharded_pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.hub, self.boundary, self.sharded_pg = hub, boundary, sharded_pg
        if accumulate and sharded_pg is not None:
            raise ValueError("Grassmann updates accumulate G^T G of the whole residual gradient: not "
                             "on a sharded stream")
        d = hub.basis.shape[0]
        # A of this boundary, persistent so a resumed run keeps what it accumulated since the last update
        self.register_buffer("grad_gram", torch.zeros(d, d) if accumulate else torch.zeros(0))
        if accumulate:
            hub.decoders.append(self)

    def _accumulate(self, grad: torch.Tensor) -> None:
        g = grad.detach().reshape(-1, grad.shape[-1]).float()
        self.grad_gram.add_(g.T @ g)

    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        z = from_wire(wire)
        mine = feature_shard(self.sharded_pg, self.hub.basis.shape[0])
        if self.sharded_pg is not None:
            z = differentiable_identity(z, group=self.sharded_pg)  # backward: dZ summed over the feature shards
        x = z @ self.hub.basis[mine].T + self.hub.fixed[input_ids][..., mine]
        if self.grad_gram.numel() and x.requires_grad:
            x.register_hook(self._accumulate)  # the sum of both uses' gradients: G of the residual stream
        return x, x


class SubspaceCodec(BoundaryCodec):
    """Exact only with the split embedding and the span(U) constraint: checked at config load
    (nanotron_ext.subspace.technique), where model.codec.kind = subspace brings both."""

    needs_token_ids = True

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, hub: SubspaceHub,
                 residual_sharded: bool = False) -> None:
        super().__init__(cfg, tp_pg)
        self.hub = hub
        self.sharded_pg = tp_pg if residual_sharded and tp_pg.size() > 1 else None

    def wire_replicated(self, residual_sharded: bool) -> bool:
        return True  # Z is all-reduced over TP on a sharded stream, and computed alike on a replicated one

    def encoder(self, boundary: int) -> BoundaryEncoder:
        return SubspaceEncoder(self.hub, self.wire_dtype, self.sharded_pg)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return SubspaceDecoder(self.hub, boundary, accumulate=self.cfg.subspace.grassmann_every > 0,
                               sharded_pg=self.sharded_pg)
