"""What the toy technique builds for one model (imported only when a model is built)."""
from __future__ import annotations

import torch
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelEmbedding
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder
from nanotron_ext.models.constraints import OutputConstraint
from nanotron_ext.parallel.data_parallel import DataParallelSync
from nanotron_ext.technique import Pieces


def toy_basis(d: int) -> torch.Tensor:
    """A fixed d x 4 orthonormal basis (the toy constraint keeps output projections in its span)."""
    return torch.linalg.qr(torch.randn(d, 4, generator=torch.Generator().manual_seed(3)))[0]


class TruncEncoder(BoundaryEncoder):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, residual, branch, input_ids):
        return (residual + branch)[..., :self.width]


class PadDecoder(BoundaryDecoder):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d

    def forward(self, wire, input_ids):
        x = nn.functional.pad(wire, (0, self.d - wire.shape[-1]))
        return x, x


class TruncCodec(BoundaryCodec):
    def encoder(self, boundary: int) -> BoundaryEncoder:
        return TruncEncoder(self.cfg.codec.toy.width)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return PadDecoder(self.cfg.hidden_size)


class Doubled(TensorParallelEmbedding):  # same parameter names as the standard table: same init
    def forward(self, input_ids):
        return 2 * super().forward(input_ids)


class SpanConstraint(OutputConstraint):
    """Keeps each output projection's columns in span(U) (U fixed, d x 4), by projecting W <- U U^T W."""

    def _project(self, projections) -> None:
        u = toy_basis(self.cfg.hidden_size)
        for lin in projections.values():
            lin.weight.data.copy_(u @ (u.T @ lin.weight.data))

    def constrain(self, layer_idx, projections) -> None:
        self._project(projections)

    def after_step(self, layer_idx, projections) -> None:
        self._project(projections)


class AverageEvery(DataParallelSync):
    """Local SGD: no gradient traffic; parameters averaged over DP after every toy_sync.every steps."""

    def after_step(self, step: int) -> None:
        if step % self.cfg.toy_sync.every == 0:
            for p in self.model.parameters():
                dist.all_reduce(p.data, group=self.dp_pg)
                p.data /= self.dp_pg.size()


class ToyPieces(Pieces):
    def codec(self, name, strategy):
        return TruncCodec(self.cfg, self.tp_pg)

    def embedding(self, name, strategy):
        return Doubled(self.cfg.vocab_size, self.cfg.hidden_size, pg=strategy.tp_pg,
                       mode=TensorParallelLinearMode.ALL_REDUCE)

    def output_constraint(self, name, strategy):
        return SpanConstraint(self.cfg, self.tp_pg)

    def dp_sync(self, name, model, ctx, cfg):
        return AverageEvery(model, ctx, cfg)

    @classmethod
    def optimizer(cls, tag, params, cfg):
        return torch.optim.SGD(params, lr=cfg.lr)
