"""The core's own technique object: the dense Llama's defaults (megatron, the identity codec and the lossy
baselines, the standard embedding, no output constraint, the per-step gradient all-reduce), declared like a
technique package's and registered the same way (pyproject.toml's `nanotron_ext.techniques` entry point
`core`), so every name reaches its builder through the registry. Its pieces are `models.pieces.CorePieces`.

Like every `Technique` module, this one imports no torch: the closed forms and the parameter count are imported
when `config show` (or a planner) asks for them.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from nanotron_ext.registry import residual_sharded
from nanotron_ext.technique import Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config
    from nanotron_ext.metrics.tier_bytes import TierBytes


class CoreTechnique(Technique):
    """The core's defaults, declared like a technique so every name reaches its builder the same way."""

    name = "core"
    provides = {
        "model.tp_strategy": ["megatron"],
        "model.codec.kind": ["identity", "topk", "int8", "int4", "lowrank"],
        "model.embedding.kind": ["standard"],
        "model.output_constraint.kind": ["none"],
        "parallelism.dp_sync": ["allreduce"],
    }
    pieces = "nanotron_ext.models.pieces:CorePieces"

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        from nanotron_ext.metrics import tier_bytes as tb

        if key == "model.tp_strategy":
            return tb.megatron_tp(cfg)
        if key == "model.codec.kind":  # these wires follow the residual stream (BoundaryCodec.wire_replicated)
            form = tb.identity_wire(cfg) if name == "identity" else tb.lossy_wire(cfg, name)
            sharded = residual_sharded(cfg.model.tp_strategy, cfg.parallelism.tp)
            return dataclasses.replace(form, tp_sharded=True) if form is not None and sharded else form
        if key == "parallelism.dp_sync":
            from nanotron_ext.models.param_count import count_params

            return tb.dense_dp(cfg, count_params(cfg))
        return None


technique = CoreTechnique()
