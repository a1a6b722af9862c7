"""What ResBM builds for a model: its boundary codec (model.codec.kind = resbm)."""
from __future__ import annotations

from nanotron_ext.codecs.base import BoundaryCodec
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.resbm.codec import ResBMCodec
from nanotron_ext.technique import Pieces


class ResBMPieces(Pieces):
    def codec(self, name: str, strategy: TPStrategy) -> BoundaryCodec:
        return ResBMCodec(self.cfg, self.tp_pg, strategy)
