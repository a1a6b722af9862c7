"""What MAPL builds for a model: its boundary codec (model.codec.kind = mapl) and SPEL for the projections."""
from __future__ import annotations

from typing import List

import torch

from nanotron_ext.codecs.base import BoundaryCodec
from nanotron_ext.config.schema import OptimizerConfig
from nanotron_ext.mapl.codec import MaplCodec
from nanotron_ext.mapl.spel import build_spel
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.technique import Pieces


class MaplPieces(Pieces):
    def codec(self, name: str, strategy: TPStrategy) -> BoundaryCodec:
        return MaplCodec(self.cfg, self.tp_pg, strategy)

    @classmethod
    def optimizer(cls, tag: str, params: List[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        return build_spel(params, cfg)
