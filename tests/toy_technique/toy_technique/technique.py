"""The toy's Technique: its two sections, the names it provides, and its one rule (light: no torch, so a config
that names "toy_trunc" is checked without importing pieces.py)."""
from __future__ import annotations

from nanotron_ext.config.checks import require
from nanotron_ext.technique import Technique
from toy_technique.config import ToyCodecConfig, ToySyncConfig


class ToyTechnique(Technique):
    name = "toy"
    sections = {"model.codec.toy": ToyCodecConfig, "toy_sync": ToySyncConfig}
    provides = {
        "model.codec.kind": ["toy_trunc"],
        "model.embedding.kind": ["toy_doubled"],
        "model.output_constraint.kind": ["toy_span"],
        "optimizer group": ["toy_sgd"],
        "parallelism.dp_sync": ["toy_average"],
    }
    # what the core needs to know about the toy, declared here so the core names none of its keys:
    resume_keys = ("model.codec.toy", "toy_sync")  # (the default, its sections, spelled out): a resume keeps them
    widths = ("model.codec.toy.width",)  # the wire's width scales with the hidden size in the clock's twin
    uncompressed = ("toy_sync.every=1",)  # the uncompressed twin averages every step
    pieces = "toy_technique.pieces:ToyPieces"

    def check_model(self, model) -> None:
        if model.codec.kind == "toy_trunc":
            require(model.codec.toy.width < model.hidden_size, "model.codec.toy.width",
                    f"{model.codec.toy.width} must be < model.hidden_size={model.hidden_size}")


technique = ToyTechnique()
