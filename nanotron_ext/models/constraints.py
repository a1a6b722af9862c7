"""Per-layer constraints on output projections: the extension point for techniques that keep what a
layer writes into the residual stream inside a subspace (Subspace Models' span(U) constraint).

`constrain` runs once per local layer after the weights are initialised (build_model), with that
layer's output projections as the TP strategy names them ({"attn_out": ..., "mlp_down": ...}); a
constraint may project or reparameterise them there (W = U W_small). The trainer calls `after_step` after every optimiser step
(re-projection). Constraints register in OUTPUT_CONSTRAINTS under `model.output_constraint.kind`.
"""
from __future__ import annotations

from typing import Dict

from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.registry import OUTPUT_CONSTRAINTS

Projections = Dict[str, nn.Module]


class OutputConstraint:
    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg, self.tp_pg = cfg, tp_pg

    def constrain(self, layer_idx: int, projections: Projections) -> None:
        """Once the weights are initialised, for each layer on this rank."""

    def after_step(self, layer_idx: int, projections: Projections) -> None:
        """After every optimiser step, for each layer on this rank."""


@OUTPUT_CONSTRAINTS.register("none")
class NoConstraint(OutputConstraint):
    pass


def get_output_constraint(cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> OutputConstraint:
    return OUTPUT_CONSTRAINTS.get(cfg.output_constraint.kind)(cfg, tp_pg)
