"""Subspace Models' Technique: the `model.subspace` section, its codec, embeddings, output constraint and
modified-AdamW group, and the one switch: `model.codec.kind: subspace` brings the split embedding and the
span(U) constraint the codec is exact with (each can be overridden, and a choice that breaks exactness
is a config error naming both keys)."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from nanotron_ext.config.checks import require
from nanotron_ext.registry import residual_sharded
from nanotron_ext.subspace.config import SubspaceConfig
from nanotron_ext.technique import GatedWork, Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config, ModelConfig
    from nanotron_ext.metrics.tier_bytes import TierBytes

SUBSPACE_ADAMW_TAG = "subspace_adamw"
SPLIT_EMBEDDINGS = ("subspace", "subspace_adapted")  # T_fixed + a part in span(U): what the codec subtracts


class SubspaceTechnique(Technique):
    name = "subspace"
    sections = {"model.subspace": SubspaceConfig}
    widths = ("model.subspace.k",)  # k = d/8 in the paper
    provides = {"model.codec.kind": ["subspace"], "model.embedding.kind": list(SPLIT_EMBEDDINGS),
                "model.output_constraint.kind": ["subspace"], "optimizer group": [SUBSPACE_ADAMW_TAG]}
    pieces = "nanotron_ext.subspace.pieces:SubspacePieces"

    def resolve_model(self, model: "ModelConfig") -> None:
        if model.codec.kind == "subspace":
            if model.embedding.kind is None:
                model.embedding.kind = "subspace"
            if model.output_constraint.kind is None:
                model.output_constraint.kind = "subspace"

    def check_model(self, model: "ModelConfig") -> None:
        sub, d = model.subspace, model.hidden_size
        require(sub.k is None or sub.k <= d, "model.subspace.k", f"{sub.k} exceeds model.hidden_size={d}")
        if model.codec.kind == "subspace":
            require(model.embedding.kind in SPLIT_EMBEDDINGS, "model.embedding.kind",
                    f"{model.embedding.kind!r} with model.codec.kind='subspace': the codec is exact only with a split "
                    f"embedding ({' or '.join(SPLIT_EMBEDDINGS)}); leave model.embedding.kind unset to get it")
            require(model.output_constraint.kind == "subspace", "model.output_constraint.kind",
                    f"{model.output_constraint.kind!r} with model.codec.kind='subspace': the codec is exact only while "
                    "every compressed block writes into span(U); leave model.output_constraint.kind unset to get it")
        if model.output_constraint.kind == "subspace":
            require(not (sub.parameterisation == "reparam" and sub.modified_adamw), "model.subspace.modified_adamw",
                    "applies to parameterisation='projection' (W_small of 'reparam' is unconstrained and uses plain "
                    "AdamW)")
        if model.embedding.kind == "subspace_adapted":
            require(not model.tie_embeddings, "model.tie_embeddings",
                    "true is not supported with model.embedding.kind='subspace_adapted' (the table is T_S + T_fixed, "
                    "not one parameter); set model.tie_embeddings=false")

    def check(self, cfg: "Config") -> None:
        """On a residual stream sharded over TP (btp at tp > 1) the codec, split embeddings and span(U)
        constraint run per feature shard (codec.py, embedding.py, constraints.py); two options need all d
        features on one rank and are refused here, naming both keys."""
        m, tp = cfg.model, cfg.parallelism.tp
        if not residual_sharded(m.tp_strategy, tp):
            return
        layout = f"with model.tp_strategy={m.tp_strategy!r} at parallelism.tp={tp}"
        if "subspace" in (m.codec.kind, m.output_constraint.kind) or m.embedding.kind in SPLIT_EMBEDDINGS:
            require(m.subspace.grassmann_every == 0, "model.subspace.grassmann_every",
                    f"{m.subspace.grassmann_every} cannot run {layout}: a Grassmann update accumulates G^T G of the "
                    "whole d-wide residual gradient, which the strategy shards on d; set it to 0 or "
                    "parallelism.tp=1")
        if m.output_constraint.kind == "subspace" and m.subspace.parameterisation == "projection":
            require(not m.subspace.modified_adamw, "model.subspace.modified_adamw",
                    f"true cannot run {layout}: its second moment is a mean over all d output rows, which the "
                    "strategy shards on d; set it to false or parallelism.tp=1")

    def gated_work(self, cfg: "Config") -> List[GatedWork]:
        """The Grassmann update of U every model.subspace.grassmann_every optimiser steps (its all-reduces)."""
        every = cfg.model.subspace.grassmann_every
        if not every or cfg.model.output_constraint.kind != "subspace":  # its after_step runs the update
            return []
        return [grassmann_work(every, cfg.model.hidden_size, "Grassmann update of U (model.subspace.grassmann_every)")]

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """Z (k wide) and the token ids (int32) cross, and Z's gradient back in a tensor of the same width
        (sec. 4.3; nanotron_ext.subspace.codec)."""
        if key != "model.codec.kind":
            return None
        from nanotron_ext.metrics.tier_bytes import element_size, wire_bytes

        k, e = cfg.model.subspace.width(cfg.model.hidden_size), element_size(cfg.model)
        return wire_bytes(cfg, k * e + 4, k * e + 4, f"k x {e} B + a 4 B token id (k = {k})")


def grassmann_bytes(d: int) -> int:
    """What one rank hands to a Grassmann update's all-reduces (nanotron_ext.subspace.grassmann.agreed_gram): the
    last codec boundary's index (int64), then A = sum G^T G (d x d) and its count in float64."""
    return 8 + 8 * (d * d + 1)


def grassmann_work(every: int, d: int, what: str) -> "GatedWork":
    return GatedWork("grassmann", every, what, {"world": grassmann_bytes(d)},
                     "an int64 boundary index + A (d x d) and its count in float64: 8 + 8 (d^2 + 1) B, one rank")


def heterogeneous_replica(model: "ModelConfig", compressed: bool, *, reproject: bool, modified_adamw: bool,
                          grassmann_every: int) -> None:
    """Set the Subspace keys of one replica of heterogeneous SparseLoCo (in place, on that replica's copy):
    every replica embeds with the adapted split table (the same parameters everywhere); a compressed one
    also sends through the subspace codec with full output weights kept in span(U) (parameterisation
    "projection", so parameter names and shapes match the uncompressed replicas for SparseLoCo's average)."""
    model.embedding.kind = "subspace_adapted"
    if compressed:
        model.codec.kind = "subspace"
        model.output_constraint.kind = "subspace"
        model.subspace.parameterisation = "projection"
        model.subspace.reproject = reproject
        model.subspace.modified_adamw = modified_adamw
        model.subspace.grassmann_every = grassmann_every


technique = SubspaceTechnique()
