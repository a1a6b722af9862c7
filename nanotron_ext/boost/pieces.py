"""What BOOST builds for a model: its TP strategies (model.tp_strategy = vanilla or btp)."""
from __future__ import annotations

from nanotron_ext.boost.strategies import BTPStrategy, VanillaStrategy
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.technique import Pieces

STRATEGIES = {"vanilla": VanillaStrategy, "btp": BTPStrategy}


class BoostPieces(Pieces):
    def tp_strategy(self, name: str) -> TPStrategy:
        return STRATEGIES[name](self.cfg, self.tp_pg)
