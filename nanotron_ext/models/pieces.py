"""The pieces of one model build: `CorePieces` (the core's defaults, declared by nanotron_ext.models.technique)
and `ModelPieces`, which asks the technique that provides each name the config chose for its piece.

    pieces = ModelPieces(cfg.model, tp_pg)      # once per model build
    strategy = pieces.tp_strategy()             # model.tp_strategy
    codec = pieces.codec(strategy)              # model.codec.kind
    embedding = pieces.embedding(strategy)      # model.embedding.kind
    constraint = pieces.output_constraint(strategy)

Each technique's `Pieces` object is created on first use and kept for the model's life: pieces of one
technique share state through it (Subspace Models' basis), and two models share nothing.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec
from nanotron_ext.codecs.identity import IdentityCodec
from nanotron_ext.codecs.lossy import Int4Codec, Int8Codec, LowRankCodec, TopKCodec
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.constraints import NoConstraint, OutputConstraint
from nanotron_ext.models.tp_strategy import MegatronStrategy, TPStrategy
from nanotron_ext.parallel.data_parallel import DataParallelSync, GradientAllReduce
from nanotron_ext.registry import CODECS, DP_SYNCS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES, ExtensionPoint
from nanotron_ext.technique import Pieces

CORE_CODECS = {"identity": IdentityCodec, "topk": TopKCodec, "int8": Int8Codec, "int4": Int4Codec,
               "lowrank": LowRankCodec}


class CorePieces(Pieces):
    """megatron, the identity codec and the lossy baselines, the strategy's own table, no constraint, and
    the per-step gradient all-reduce."""

    def tp_strategy(self, name: str) -> TPStrategy:
        return MegatronStrategy(self.cfg, self.tp_pg)

    def codec(self, name: str, strategy: TPStrategy) -> BoundaryCodec:
        return CORE_CODECS[name](self.cfg, self.tp_pg)

    def embedding(self, name: str, strategy: TPStrategy) -> nn.Module:
        return strategy.embedding()

    def output_constraint(self, name: str, strategy: TPStrategy) -> OutputConstraint:
        return NoConstraint(self.cfg, self.tp_pg)

    def dp_sync(self, name: str, model: nn.Module, ctx: ParallelContext, cfg: Any) -> DataParallelSync:
        return GradientAllReduce(model, ctx, cfg)


class ModelPieces:
    """The technique pieces of one model (see module docstring)."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg, self.tp_pg = cfg, tp_pg
        self._by_technique: Dict[str, Pieces] = {}

    def owner(self, point: ExtensionPoint, name: str) -> Pieces:
        """The Pieces object of the technique that provides `name` at `point` (created once per model)."""
        technique = point.owner(name)
        if technique.name not in self._by_technique:
            self._by_technique[technique.name] = technique.pieces_class()(self.cfg, self.tp_pg)
        return self._by_technique[technique.name]

    def get(self, technique: str) -> Optional[Pieces]:
        """This model's Pieces object of `technique` when the model's config names one of its pieces (created
        here if no piece was built on this rank: e.g. a later pipeline stage of a model whose only Subspace
        piece, the embedding, lives on the first); None when the model does not use the technique."""
        if technique not in self._by_technique:
            chosen = ((TP_STRATEGIES, self.cfg.tp_strategy), (CODECS, self.cfg.codec.kind),
                      (EMBEDDINGS, self.cfg.embedding.kind), (OUTPUT_CONSTRAINTS, self.cfg.output_constraint.kind))
            named = next(((point, name) for point, name in chosen if point.owner(name).name == technique), None)
            if named is None:
                return None
            self.owner(*named)
        return self._by_technique[technique]

    def tp_strategy(self) -> TPStrategy:
        name = self.cfg.tp_strategy
        return self.owner(TP_STRATEGIES, name).tp_strategy(name)

    def codec(self, strategy: TPStrategy) -> BoundaryCodec:
        name = self.cfg.codec.kind
        return self.owner(CODECS, name).codec(name, strategy)

    def embedding(self, strategy: TPStrategy) -> nn.Module:
        name = self.cfg.embedding.kind
        return self.owner(EMBEDDINGS, name).embedding(name, strategy)

    def output_constraint(self, strategy: TPStrategy) -> OutputConstraint:
        name = self.cfg.output_constraint.kind
        return self.owner(OUTPUT_CONSTRAINTS, name).output_constraint(name, strategy)

    def dp_sync(self, name: str, model: nn.Module, ctx: ParallelContext, cfg: Any) -> DataParallelSync:
        """parallelism.dp_sync = `name` for this model's replica (`cfg`: the replica's run config)."""
        return self.owner(DP_SYNCS, name).dp_sync(name, model, ctx, cfg)
