"""What Subspace Models build for one model, and the state they share: the hub holding U and T_fixed,
created once per model build (so two models in one process never share a basis)."""
from __future__ import annotations

from typing import List, Optional

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec
from nanotron_ext.config.schema import ModelConfig, OptimizerConfig
from nanotron_ext.models.constraints import OutputConstraint
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.subspace.basis import SubspaceHub
from nanotron_ext.subspace.codec import SubspaceCodec
from nanotron_ext.subspace.constraints import SubspaceConstraint
from nanotron_ext.subspace.embedding import adapted_split_embedding, split_embedding
from nanotron_ext.subspace.optim import subspace_adamw
from nanotron_ext.technique import Pieces


class SubspacePieces(Pieces):
    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__(cfg, tp_pg)
        self._hub: Optional[SubspaceHub] = None

    @property
    def hub(self) -> SubspaceHub:
        """U, T_fixed and the Grassmann state every Subspace piece of this model holds (one per model)."""
        if self._hub is None:
            self._hub = SubspaceHub(self.cfg)
        return self._hub

    def codec(self, name: str, strategy: TPStrategy) -> BoundaryCodec:
        return SubspaceCodec(self.cfg, self.tp_pg, self.hub, residual_sharded=strategy.residual_sharded)

    def embedding(self, name: str, strategy: TPStrategy) -> nn.Module:
        build = split_embedding if name == "subspace" else adapted_split_embedding
        return build(self.cfg, strategy, self.hub)

    def output_constraint(self, name: str, strategy: TPStrategy) -> OutputConstraint:
        return SubspaceConstraint(self.cfg, self.tp_pg, self.hub)

    @classmethod
    def optimizer(cls, tag: str, params: List[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        return subspace_adamw(params, cfg)


def hub_of(model: nn.Module) -> SubspaceHub:
    """The hub of a model whose config names a Subspace piece (LlamaForTraining.techniques), on every rank
    of it (a stage that builds no Subspace piece still shares U and T_fixed, e.g. for Grassmann updates)."""
    pieces = model.techniques.get("subspace")
    if pieces is None:
        raise ValueError("this model has no Subspace piece (model.codec/embedding/output_constraint.kind)")
    return pieces.hub
