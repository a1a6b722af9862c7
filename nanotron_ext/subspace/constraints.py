"""Constrained output projections of Subspace Models (sec. 4.3): every compressed block's attention
output and MLP down projection write into span(U), in one of two parameterisations
(model.subspace.parameterisation):

- projection: the full weight W [d, d_in] (PyTorch layout) kept in span(U), W <- U U^T W at build time and,
  with model.subspace.reproject, after every optimiser step; optionally stepped by the sec. 5 modified
  AdamW (nanotron_ext.subspace.optim). Exact only while the constraint holds: a stage holding several
  blocks gives its inner blocks out-of-span gradients, so without re-projection W drifts;
- reparam: W = U W_small with W_small [k, d_in] the trained parameter, exact by construction (what the
  public ProtocolNanoGPT does). The nanotron linear is turned into a `SubspaceRowLinear` or
  `SubspaceColumnLinear` at constrain time (its class swapped, its weight replaced by W_small = U^T W), so
  its sharding and collectives stay nanotron's.

Which linear is constrained is the TP strategy's answer to "what writes into the residual stream"
(TPStrategy.output_projections): Megatron's row-parallel o_proj / down_proj (W [d, d_in / tp]: all d rows
on every rank, d_in split), or under BOOST's bottleneck-aware TP (btp) the UP factor of a low-rank pair,
column-parallel, W [d / tp, r]: rank r holds the rows S_r, the features of its residual shard (a full-rank
btp projection is row-parallel with all d rows, like Megatron's). A low-rank linear's effective weight is
up @ h(down(.)) for SVD (h = id), CoLA (h = silu) and LaX (h adds a latent): its output lies in the column
span of `up`, so constraining the up factor constrains the effective weight, whatever h is.

Rows sharded over TP (btp; Protocol Models, arXiv:2506.01260, sec. 4.3 applied per feature shard). With U_S
the rows S of U, U^T W = sum_r U_{S_r}^T W_{S_r} (k x d_in), so
- projection: W_{S_r} <- U_{S_r} C with C = sum_r U_{S_r}^T W_{S_r}, ONE all-reduce of the k x d_in C over TP
  (at build time and after each re-projection; no gradient is involved: the optimiser steps W_{S_r}
  locally and re-projection restores the constraint);
- reparam: W_{S_r} = U_{S_r} C with C [k, d_in] replicated over TP (the same parameter on every rank,
  initialised from the all-reduced U^T W). Forward needs no communication; backward, each rank's dC =
  U_{S_r}^T dW_{S_r} is only its shard's part, so C enters through nanotron's differentiable_identity
  (backward: all-reduce of the k x d_in dC, as for the shared qk-norm weight) and every rank steps the
  same C. Rows replicated (Megatron, or btp at tp = 1) need neither all-reduce.
The modified AdamW's column mean over d and Grassmann updates need all d rows: refused with btp at tp > 1
at config load (nanotron_ext.subspace.technique).

The constraint object also drives the Grassmann update of U (sec. 4.5): `after_step` of this rank's last
layer counts optimiser steps and, every model.subspace.grassmann_every steps, calls
nanotron_ext.subspace.grassmann.grassmann_update (a collective over all ranks; every rank runs it).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import SplitConfig, create_sharded_parameter_from_config
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import differentiable_identity
from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear, TensorParallelRowLinear
from torch import nn

from nanotron_ext.codecs.base import feature_shard
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


def row_group(linear: nn.Module) -> Optional[dist.ProcessGroup]:
    """The TP group the rows (output features, d) of `linear`'s weight are sharded over; None when this rank
    holds all d rows (row-parallel linears: their input features are what TP splits)."""
    if isinstance(linear, TensorParallelColumnLinear) and linear.pg.size() > 1:
        return linear.pg
    return None


def basis_rows(hub: SubspaceHub, linear: nn.Module) -> torch.Tensor:
    """U_S: the rows of U matching the rows of `linear`'s weight this rank holds."""
    return hub.basis[feature_shard(row_group(linear), hub.basis.shape[0])]


@torch.no_grad()
def project_(linear: nn.Module, hub: SubspaceHub) -> None:
    """W <- U U^T W in place; on TP-sharded rows W_S <- U_S sum_r U_{S_r}^T W_{S_r} (one all-reduce, k x d_in)."""
    w, pg = linear.weight, row_group(linear)
    u = basis_rows(hub, linear).float()
    coords = u.T @ w.float()
    if pg is not None:
        dist.all_reduce(coords, op=dist.ReduceOp.SUM, group=pg)
    w.copy_((u @ coords).to(w.dtype))


class SubspaceRowLinear(TensorParallelRowLinear):
    """Row-parallel linear whose weight is computed: weight = U @ weight_small ([d, k] @ [k, d_in / tp])."""

    hub: SubspaceHub
    weight_small: nn.Parameter

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.hub.basis.to(self.weight_small.dtype) @ self.weight_small

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The collective-free GEMM BOOST's btp sub-layers call (nanotron_ext.boost.btp.RowParallelLinear.local)."""
        return F.linear(x, self.weight)

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


class SubspaceColumnLinear(TensorParallelColumnLinear):
    """Column-parallel linear writing this rank's residual features S_r (btp's up factor): weight = U_{S_r} C
    ([d / tp, k] @ [k, d_in]) with C = `weight_small` replicated over TP (see module docstring)."""

    hub: SubspaceHub
    weight_small: nn.Parameter

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        small = self.weight_small
        if self.pg.size() > 1:
            small = differentiable_identity(small, group=self.pg)  # backward: dC summed over the row shards
        return basis_rows(self.hub, self).to(small.dtype) @ small

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The collective-free GEMM BOOST's btp sub-layers call (nanotron_ext.boost.btp.ColumnParallelLinear.local)."""
        return F.linear(x, self.weight)

    def full_weight(self, full: FullTensor) -> torch.Tensor:
        """The unsharded weight U C [d, d_in] (what a low-rank pair's dense equivalent multiplies out)."""
        return self.hub.basis.double().cpu() @ full(self.weight_small).double()


@torch.no_grad()
def reparameterise_(linear: nn.Module, hub: SubspaceHub) -> nn.Module:
    """Turn `linear` (W initialised) into a SubspaceRowLinear / SubspaceColumnLinear with W_small = U^T W
    (summed over the row shards when TP shards W's rows), in place."""
    if isinstance(linear, TensorParallelRowLinear):
        w = linear._parameters.pop("weight")
        small = nn.Parameter(hub.basis.to(w.dtype).T @ w.detach())
        linear.__class__ = SubspaceRowLinear
        linear.weight_small = create_sharded_parameter_from_config(
            parameter=small, pg=linear.pg, split_config=SplitConfig(split_dim=1))
    elif isinstance(linear, TensorParallelColumnLinear):
        w, pg = linear._parameters.pop("weight"), row_group(linear)
        small = basis_rows(hub, linear).float().T @ w.detach().float()
        if pg is not None:
            dist.all_reduce(small, op=dist.ReduceOp.SUM, group=pg)
        linear.__class__ = SubspaceColumnLinear
        linear.weight_small = nn.Parameter(small.to(w.dtype))  # replicated over TP: the same C on every rank
    else:
        raise ConfigError(f"model.subspace.parameterisation='reparam' needs nanotron row- or column-parallel output "
                          f"projections, got {type(linear).__name__}")
    linear.hub = hub
    return linear


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
                project_(lin, self.hub)
                if self.sub.modified_adamw:
                    tag_parameter(lin.weight, SUBSPACE_ADAMW_TAG)
            self.hub.constrained.append(lin)

    @torch.no_grad()
    def after_step(self, layer_idx: int, projections: Projections) -> None:
        if self.compressed(layer_idx) and self.sub.parameterisation == "projection" and self.sub.reproject:
            for lin in projections.values():
                project_(lin, self.hub)
        if layer_idx == max(self.layers):  # once per optimiser step on every rank
            self.hub.steps += 1
            every = self.sub.grassmann_every
            if every and self.hub.grassmann_in_step and int(self.hub.steps) % every == 0:
                grassmann_update([self.hub])
