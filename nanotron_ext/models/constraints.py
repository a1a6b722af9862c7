"""Per-layer constraints on output projections: the extension point for techniques that keep what a
layer writes into the residual stream inside a subspace (Subspace Models' span(U) constraint).

`constrain` runs once per local layer after the weights are initialised (build_model), with that
layer's output projections as the TP strategy names them ({"attn_out": ..., "mlp_down": ...}); a
constraint may project or reparameterise them there (W = U W_small). The trainer calls `after_step` after every
optimiser step (re-projection). `model.output_constraint.kind` names one; the technique providing the name builds it
(nanotron_ext.technique.Pieces.output_constraint).
"""
from __future__ import annotations

from typing import Dict

from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import ModelConfig

Projections = Dict[str, nn.Module]


class OutputConstraint:
    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg, self.tp_pg = cfg, tp_pg

    def constrain(self, layer_idx: int, projections: Projections) -> None:
        """Once the weights are initialised, for each layer on this rank."""

    def after_step(self, layer_idx: int, projections: Projections) -> None:
        """After every optimiser step, for each layer on this rank."""


class NoConstraint(OutputConstraint):
    pass
