"""The identity codec: the hidden state crosses the boundary unchanged."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder


class IdentityEncoder(BoundaryEncoder):
    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        return residual + branch


class IdentityDecoder(BoundaryDecoder):
    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        return wire, wire


class IdentityCodec(BoundaryCodec):
    def encoder(self, boundary: int) -> BoundaryEncoder:
        return IdentityEncoder()

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return IdentityDecoder()
