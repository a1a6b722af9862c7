"""The identity codec: the hidden state crosses the boundary unchanged, in the wire dtype (codecs/base.py)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder, from_wire, to_wire


class Transparent:
    """nanotron_ext.models.dense.DenseEquivalent of a codec module that passes the hidden state on exactly: it
    adds nothing to a standard model."""

    def dense_equivalent(self, full: Callable, exact: bool = True) -> Dict[str, torch.Tensor]:
        return {}

    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        return {}


class IdentityEncoder(Transparent, BoundaryEncoder):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        return to_wire(residual + branch, self.dtype)


class IdentityDecoder(Transparent, BoundaryDecoder):
    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x = from_wire(wire)
        return x, x


class IdentityCodec(BoundaryCodec):
    def encoder(self, boundary: int) -> BoundaryEncoder:
        return IdentityEncoder(self.wire_dtype)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return IdentityDecoder()
