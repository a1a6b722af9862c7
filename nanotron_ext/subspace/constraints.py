"""Constrained output projections of Subspace Models (sec. 4.3): every compressed block's attention
output and MLP down projection write into span(U), in one of two parameterisations
(model.subspace.parameterisation):

- projection: the full weight W [d, d_in] (PyTorch layout) kept in span(U), W <- U U^T W at build time and,
  with model.subspace.reproject, after every optimiser step; optionally stepped by the sec. 5 modified
  AdamW (nanotron_ext.subspace.optim). Exact only while the constraint holds: a stage holding several
  blocks gives its inner blocks out-of-span gradients, so without re-projection W drifts;
- reparam: W = U W_small with W_small [k, d_in] the trained parameter, exact by construction (what the
  public ProtocolNanoGPT does). The nanotron TensorParallelRowLinear instance is turned into a
  `SubspaceRowLinear` at constrain time (its class swapped, its weight replaced by W_small = U^T W), so the
  row-parallel sharding (d_in split over TP, U applied on the output side identically on every TP rank)
  and the all-reduce stay nanotron's.

The constraint object also drives the Grassmann update of U (sec. 4.5): `after_step` of this rank's last
layer counts optimiser steps and, every model.subspace.grassmann_every steps, calls
nanotron_ext.subspace.grassmann.grassmann_update (a collective over all ranks; every rank runs it).
"""
from __future__ import annotations

from typing import Dict, List

import torch
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import SplitConfig, create_sharded_parameter_from_config
from nanotron.parallel.tensor_parallel.nn import TensorParallelRowLinear
from torch import nn

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.constraints import OutputConstraint, Projections
from nanotron_ext.models.dense import FullTensor
from nanotron_ext.models.init import local_shard
from nanotron_ext.optim.param_groups import tag_parameter
from nanotron_ext.subspace.basis import SubspaceHub
from nanotron_ext.subspace.grassmann import grassmann_update
from nanotron_ext.subspace.technique import SUBSPACE_ADAMW_TAG

# Rows of W live in d; the subspace acts on dim 0 of nn.Linear's [d_out, d_in] weight.


class SubspaceRowLinear(TensorParallelRowLinear):
    """Row-parallel linear whose weight is computed: weight = U @ weight_small ([d, k] @ [k, d_in / tp])."""

    hub: SubspaceHub
    weight_small: nn.Parameter

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.hub.basis.to(self.weight_small.dtype) @ self.weight_small

    # nanotron_ext.models.dense.DenseEquivalent: the row linear with weight W = U W_small
    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        return {"weight": (self.hub.basis.double() @ full(self.weight_small).double()).float()}

    @torch.no_grad()
    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """W_small = U^T W: the span(U) part of W (the rest is lost; its relative size is returned)."""
        w = dense["weight"].double()
        u = self.hub.basis.double().cpu()
        small = u.T @ w
        self.weight_small.copy_(local_shard(small.float(), self.weight_small).to(self.weight_small.dtype))
        return {"weight": float((w - u @ small).norm() / w.norm().clamp_min(1e-30))}


@torch.no_grad()
def reparameterise_(linear: TensorParallelRowLinear, hub: SubspaceHub) -> SubspaceRowLinear:
    """Turn `linear` (W initialised) into a SubspaceRowLinear with W_small = U^T W, in place."""
    if not isinstance(linear, TensorParallelRowLinear):
        raise ConfigError(f"model.subspace.parameterisation='reparam' needs nanotron row-parallel output projections, "
                          f"got {type(linear).__name__} (model.low_rank.kind must be 'none')")
    w = linear._parameters.pop("weight")
    small = nn.Parameter(hub.basis.to(w.dtype).T @ w.detach())
    linear.__class__ = SubspaceRowLinear
    linear.weight_small = create_sharded_parameter_from_config(
        parameter=small, pg=linear.pg, split_config=SplitConfig(split_dim=1))
    linear.hub = hub
    return linear  # type: ignore[return-value]


class SubspaceConstraint(OutputConstraint):
    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, hub: SubspaceHub) -> None:
        super().__init__(cfg, tp_pg)
        self.hub = hub
        self.sub = cfg.subspace
        self.layers: List[int] = []

    def compressed(self, layer_idx: int) -> bool:
        return not (self.sub.last_block_uncompressed and layer_idx == self.cfg.num_layers - 1)

    @torch.no_grad()
    def constrain(self, layer_idx: int, projections: Projections) -> None:
        self.layers.append(layer_idx)
        if not self.compressed(layer_idx):
            return
        for lin in projections.values():
            if self.sub.parameterisation == "reparam":
                reparameterise_(lin, self.hub)
            else:
                lin.weight.copy_(self.hub.project(lin.weight))
                if self.sub.modified_adamw:
                    tag_parameter(lin.weight, SUBSPACE_ADAMW_TAG)
            self.hub.constrained.append(lin)

    @torch.no_grad()
    def after_step(self, layer_idx: int, projections: Projections) -> None:
        if self.compressed(layer_idx) and self.sub.parameterisation == "projection" and self.sub.reproject:
            for lin in projections.values():
                lin.weight.copy_(self.hub.project(lin.weight))
        if layer_idx == max(self.layers):  # once per optimiser step on every rank
            self.hub.steps += 1
            every = self.sub.grassmann_every
            if every and self.hub.grassmann_in_step and int(self.hub.steps) % every == 0:
                grassmann_update([self.hub])
