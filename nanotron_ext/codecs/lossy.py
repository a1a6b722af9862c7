"""Lossy baselines for a pipeline boundary (the comparison of the Protocol Models paper, sec. 8.7): top-k
sparsification, int8/int4 quantisation and per-batch low-rank projection. Both directions are compressed:
the activation X forward and, with the same scheme, the activation gradient backward (the received
wire's gradient carries the compressed gradient in the same layout, so each direction costs the same).

Each scheme maps X [b, s, d] to one wire [b, s, w] in the run's wire dtype (codecs/base.wire_dtype, element
size e: 4 B fp32, 2 B bf16) and back; everything needed to decode (values, indices, scales, factors) is
inside the wire, so the ledger counts it. Values travel in the wire dtype; integers (indices, codes, the fp32
scale) are bit-cast into it, so their bytes do not depend on it. Bytes per token:
- topk (model.codec.ratio r): per token the k = max(1, round(d / (2 r))) largest-magnitude entries,
  values + int32 indices: k (e + 4);
- int8 / int4: symmetric per-token absmax quantisation (levels +-127 / +-7), codes packed, plus one fp32
  scale: d + 4 / d/2 + 4;
- lowrank (ratio r): X (b*s x d) ~ A B^T, the truncated SVD of rank q = max(1, round(d / r)); each token
  carries its q coefficients (A = X B = U_q S_q) and the d x q basis B rides in ceil(d q / (b s)) extra columns:
  e (q + ceil(d q / (b s))). B = the top-q eigenvectors of the d x d Gram matrix X^T X (torch.linalg.eigh): the
  SVD's V_q, and A = X B its U_q S_q. Until issue 29 this took the full SVD of the b*s x d X (torch.linalg.svd:
  O(b s d^2) with a large constant, 72 us/token on 2 CPU cores and 2.9 us/token on an H200 at 16 x 1024 tokens,
  d = 768: 8x / 70x top-k's encode); one fp32 Gram product and one d x d eigendecomposition cost 20.5 us/token
  and 0.58 us/token there (benchmarks/results/codec_cost_{cpu,h200}.md); the reconstruction equals a float64 truncated
  SVD's (tests/test_lossy_codecs.py).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder, from_wire
from nanotron_ext.codecs.bitpack import pack_words, unpack_words


def _bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of x's last dimension as `dtype` columns (x's last dimension times its element size
    must be a multiple of dtype's)."""
    return x.contiguous().view(dtype)


class Scheme:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decompress(self, wire: torch.Tensor, d: int) -> torch.Tensor:
        raise NotImplementedError


class TopK(Scheme):
    def __init__(self, d: int, ratio: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype)
        self.k = max(1, min(d, round(d / (2 * ratio))))

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.abs().topk(self.k, dim=-1).indices
        values = x.gather(-1, idx).to(self.dtype)
        return torch.cat([values, _bitcast(idx.to(torch.int32), self.dtype)], dim=-1)

    def decompress(self, wire: torch.Tensor, d: int) -> torch.Tensor:
        values, idx = wire[..., :self.k].float(), _bitcast(wire[..., self.k:], torch.int32).long()
        return torch.zeros(*wire.shape[:-1], d, device=wire.device).scatter(-1, idx, values)


class Quantise(Scheme):
    def __init__(self, d: int, bits: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype)
        self.bits, self.levels = bits, 2 ** (bits - 1) - 1
        per_slot = 8 * torch.empty((), dtype=dtype).element_size() // bits
        if d % per_slot:
            raise ValueError(f"model.codec.kind=int{bits} needs model.hidden_size divisible by {per_slot}, got {d}")
        self.scale_slots = 4 // torch.empty((), dtype=dtype).element_size()

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / self.levels
        q = torch.round(x / scale).clamp(-self.levels, self.levels).to(torch.int8)
        if self.bits == 4:  # two codes per byte, offset to 0..14
            q = pack_words(q + self.levels, 4, word_bits=8).view(torch.int8)
        return torch.cat([_bitcast(q, self.dtype), _bitcast(scale, self.dtype)], dim=-1)

    def decompress(self, wire: torch.Tensor, d: int) -> torch.Tensor:
        codes = _bitcast(wire[..., :-self.scale_slots], torch.int8)
        scale = _bitcast(wire[..., -self.scale_slots:], torch.float32)
        if self.bits == 4:
            q = unpack_words(codes.view(torch.uint8), 4, d, word_bits=8, dtype=torch.int16) - self.levels
        else:
            q = codes
        return q.float() * scale


class LowRank(Scheme):
    def __init__(self, d: int, ratio: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dtype)
        self.q = max(1, min(d, round(d / ratio)))

    def basis_cols(self, tokens: int, d: int) -> int:
        return math.ceil(d * self.q / tokens)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        with torch.autocast(x.device.type, enabled=False):  # fp32 throughout, as the SVD it replaces
            flat = x.float().reshape(b * s, d)
            # X's top-q right singular vectors = the top-q eigenvectors of its d x d Gram matrix (eigh: ascending)
            vecs = torch.linalg.eigh(flat.T @ flat).eigenvectors[:, -self.q:].flip(-1)
            coeffs = (flat @ vecs).reshape(b, s, self.q)  # = U_q S_q
        extra = self.basis_cols(b * s, d)
        basis = torch.zeros(b * s * extra, dtype=torch.float32, device=x.device)
        basis[:d * self.q] = vecs.reshape(-1)
        return torch.cat([coeffs, basis.view(b, s, extra)], dim=-1).to(self.dtype)

    def decompress(self, wire: torch.Tensor, d: int) -> torch.Tensor:
        b, s, _ = wire.shape
        basis = wire[..., self.q:].reshape(-1)[:d * self.q].view(d, self.q).float()
        return wire[..., :self.q].float() @ basis.T


class _Encode(torch.autograd.Function):
    """Forward: compress X; backward: the gradient wire arrives compressed, decompress it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scheme: Scheme) -> torch.Tensor:  # type: ignore[override]
        ctx.scheme, ctx.d, ctx.dtype = scheme, x.shape[-1], x.dtype
        return scheme.compress(x)

    @staticmethod
    def backward(ctx, grad_wire: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.scheme.decompress(grad_wire, ctx.d).to(ctx.dtype), None


class _Decode(torch.autograd.Function):
    """Forward: decompress the wire; backward: compress the dense gradient into the wire's layout."""

    @staticmethod
    def forward(ctx, wire: torch.Tensor, scheme: Scheme, d: int) -> torch.Tensor:  # type: ignore[override]
        ctx.scheme = scheme
        return scheme.decompress(wire, d)  # fp32: the residual stream's dtype

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor) -> Tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.scheme.compress(grad_x.contiguous()), None, None


class LossyEncoder(BoundaryEncoder):
    def __init__(self, scheme: Scheme) -> None:
        super().__init__()
        self.scheme = scheme

    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        return _Encode.apply(residual + branch, self.scheme)


class LossyDecoder(BoundaryDecoder):
    def __init__(self, scheme: Scheme, d: int) -> None:
        super().__init__()
        self.scheme, self.d = scheme, d

    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x = from_wire(_Decode.apply(wire, self.scheme, self.d))
        return x, x


class LossyCodec(BoundaryCodec):
    def scheme(self) -> Scheme:
        raise NotImplementedError

    def encoder(self, boundary: int) -> BoundaryEncoder:
        return LossyEncoder(self.scheme())

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return LossyDecoder(self.scheme(), self.cfg.hidden_size)


class TopKCodec(LossyCodec):
    def scheme(self) -> Scheme:
        return TopK(self.cfg.hidden_size, self.cfg.codec.ratio, self.wire_dtype)


class Int8Codec(LossyCodec):
    def scheme(self) -> Scheme:
        return Quantise(self.cfg.hidden_size, 8, self.wire_dtype)


class Int4Codec(LossyCodec):
    def scheme(self) -> Scheme:
        return Quantise(self.cfg.hidden_size, 4, self.wire_dtype)


class LowRankCodec(LossyCodec):
    def scheme(self) -> Scheme:
        return LowRank(self.cfg.hidden_size, self.cfg.codec.ratio, self.wire_dtype)
