"""Residual vector quantisation of MAPL's wire, with codebooks streamed across the boundary.

The r-wide Z of each token is split into G groups; each group is quantised in R rounds, round t
coding the residual left by rounds < t against its own K-entry codebook. Only the indices cross:
G * R * ceil(log2 K) bits per token, packed into int32 words.

Choices the MAPL text leaves open (config model.codec.mapl.vq_*), documented here:
- The last entry of every codebook is pinned to zero, so a round can always send "nothing": the
  reconstruction error never grows with R.
- Codebooks learn by EMA k-means on the sender (decay `vq_decay`, Laplace-smoothed counts), with a
  straight-through gradient (dL/dZ := dL/dZ_hat). No commitment loss: Z is an orthonormal
  projection, so its scale is not free to drift away from the codebooks.
- Sync: each side holds a *shared* codebook; encoding and decoding use only it. Every micro-batch the
  sender streams ONE row (1/K of every group's and round's codebook, cyclically) of its learning
  codebook into the shared one, and the receiver applies the same row: after K micro-batches the
  shared codebooks equal the learning ones as streamed, identical on both sides.
- Backward: the r-wide gradient is quantised to `grad_bits` per value with one fp32 scale per token
  (absmax), packed into int32 words.

The wire (one tensor each way per boundary: nanotron_ext/codecs/base.py) is in the run's wire dtype (e = 2 B
under model.dtype bf16, 4 B fp32), as every codec's: int32 words bit-cast into it (2 columns each in bf16), values
in it. Forward the index words, then the streamed codebook row (its row number as an int32 and one row of every
codebook, R r values in the wire dtype: 4 + R r e bytes per micro-batch; the sender's shared codebook takes the
row as it crosses, rounded alike on both sides) spread over ceil((4 / e + R r) / tokens) side columns; backward
the quantised gradient words. nanotron's engines send the gradient in a tensor of the wire's own shape, so the
tensor is max(forward, backward) columns wide and marks its forward columns (mark_forward_columns): the
pipeline's P2P sends only those forward, so bytes per token are
    forward  4 + 4 ceil(G R / floor(32 / ceil(log2 K))) + e ceil((4 / e + R r) / tokens)   (ids, indices, stream)
    backward 4 + max(forward - 4, 4 (ceil(r / floor(32 / grad_bits)) + 1))               (zero id column, gradient)
e.g. r = 256, G = 8, R = 2, K = 256 at 2048 tokens: 22 B forward in bf16 (16 B of indices; 24 B in fp32) against
516 B for bf16 Z; 264 B backward with 8-bit gradients. Before the split the forward was padded to the gradient's
width (264 B at every G); until issue 29 the wire was fp32 in bf16 runs too (the row's values 4 B each).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from nanotron_ext.codecs.bitpack import pack_words, unpack_words, words_for
from nanotron_ext.parallel.p2p import mark_forward_columns


# -- index width -------------------------------------------------------------------------------------
def index_bits(codebook_size: int) -> int:
    return max(1, math.ceil(math.log2(codebook_size)))


# -- gradient quantisation ----------------------------------------------------------------------------
def quantise_gradient(g: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., r] float -> int32 words [..., words_for(r, bits) + 1]: signed absmax codes, then the fp32 scale."""
    levels = 2 ** (bits - 1) - 1
    scale = g.abs().amax(-1, keepdim=True).float().clamp_min(1e-30) / levels
    codes = torch.round(g.float() / scale).clamp(-levels, levels).long() + levels  # shifted to >= 0
    return torch.cat([pack_words(codes, bits), scale.view(torch.int32)], dim=-1)


def dequantise_gradient(words: torch.Tensor, bits: int, r: int) -> torch.Tensor:
    levels = 2 ** (bits - 1) - 1
    codes = unpack_words(words[..., :-1], bits, r) - levels
    return codes.float() * words[..., -1:].contiguous().view(torch.float32)


# -- recording / replaying code assignments ---------------------------------------------------------------
class CodeTape:
    """Every nearest-codeword decision of every ResidualQuantizer while the tape is on (`with tape:`), in call
    order, tagged "wire" (encode: the indices sent) or "learn" (the sender's k-means assignment). A fresh tape
    records; `CodeTape(codes)` replays a recording: each decision takes the recorded indices instead of this
    run's argmin and counts how many of them this run's argmin would have changed (`differ`). Replaying one
    run's tape in another (CUDA's on CPU) pins RVQ's discrete choices, so what is left to differ is the
    continuous arithmetic; the counts say how many choices a last-bit difference flipped
    (benchmarks/discrete_codec_sensitivity.py)."""

    def __init__(self, codes: Optional[List[torch.Tensor]] = None) -> None:
        self.replaying = codes is not None
        self.codes: List[torch.Tensor] = list(codes) if codes is not None else []
        self.kinds: List[str] = []
        self.differ: List[int] = []  # replay: per decision, entries whose own argmin differs from the tape

    def __enter__(self) -> "CodeTape":
        if _TAPE:
            raise RuntimeError("a CodeTape is already on")
        _TAPE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _TAPE.remove(self)

    def take(self, idx: torch.Tensor, kind: str) -> torch.Tensor:
        """The indices to use for one decision (this run's `idx` when recording)."""
        n = len(self.kinds)
        self.kinds.append(kind)
        if not self.replaying:
            self.codes.append(idx.detach().to("cpu", torch.int32))
            return idx
        if n >= len(self.codes) or self.codes[n].shape != idx.shape:
            raise RuntimeError(f"decision {n} ({kind}, {tuple(idx.shape)}) is not on the replayed tape "
                               f"({len(self.codes)} decisions): the runs differ in structure")
        forced = self.codes[n].to(idx.device, idx.dtype)
        self.differ.append(int((forced != idx).sum()))
        return forced

    def disagreement(self) -> float:
        """Replay: the fraction of replayed code entries this run's own argmin would have changed."""
        return sum(self.differ) / max(1, sum(c.numel() for c in self.codes[:len(self.differ)]))

    def state(self) -> Dict[str, list]:
        """What torch.save keeps (`CodeTape(state["codes"])` replays it)."""
        return {"codes": self.codes, "kinds": self.kinds}


_TAPE: List[CodeTape] = []  # the tape that is on, if any


# -- the quantiser ------------------------------------------------------------------------------------
class ResidualQuantizer(nn.Module):
    """G groups x R rounds x K codebook entries of width r / G; shared and learning codebooks as buffers."""

    def __init__(self, width: int, groups: int, rounds: int, codebook_size: int, decay: float) -> None:
        super().__init__()
        if width % groups:
            raise ValueError(f"model.codec.mapl.vq_groups={groups} must divide the wire width r={width}")
        self.groups, self.rounds, self.size, self.decay = groups, rounds, codebook_size, decay
        w = width // groups
        self.register_buffer("shared", torch.zeros(groups, rounds, codebook_size, w))
        self.register_buffer("learning", torch.zeros(groups, rounds, codebook_size, w))
        self.register_buffer("ema_count", torch.ones(groups, rounds, codebook_size))
        self.register_buffer("ema_sum", torch.zeros(groups, rounds, codebook_size, w))
        self.register_buffer("stream_row", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def init_codebooks_(self, generator: torch.Generator, scale: float) -> None:
        """Identical seeded codebooks on both sides (round t at scale / 2**t: residuals shrink)."""
        g, r, k, w = self.shared.shape
        book = torch.randn(g, r, k, w, generator=generator) * scale
        book *= (0.5 ** torch.arange(r, dtype=book.dtype)).view(1, r, 1, 1)
        book[:, :, -1] = 0  # the zero codeword
        self.shared.copy_(book)
        self.learning.copy_(book)
        self.ema_sum.copy_(book)
        self.ema_count.fill_(1.0)
        self.stream_row.zero_()

    def _nearest(self, residual: torch.Tensor, book: torch.Tensor, kind: str) -> torch.Tensor:
        """residual [N, G, w], book [G, K, w] -> indices [N, G] (a CodeTape that is on records or replaces them)."""
        dist = torch.cdist(residual.transpose(0, 1), book)  # [G, N, K]
        idx = dist.argmin(-1).transpose(0, 1)
        return _TAPE[0].take(idx, kind) if _TAPE else idx

    def encode(self, z: torch.Tensor, book: torch.Tensor | None = None) -> torch.Tensor:
        """z [N, r] -> indices [N, G, R] against `book` (default: the shared codebooks)."""
        book = self.shared if book is None else book
        residual = z.detach().float().view(z.shape[0], self.groups, -1)
        out = []
        for t in range(self.rounds):
            idx = self._nearest(residual, book[:, t], "wire")
            residual = residual - self._lookup(book[:, t], idx)
            out.append(idx)
        return torch.stack(out, dim=-1)

    def _lookup(self, book: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """book [G, K, w], idx [N, G] -> [N, G, w]."""
        return book[torch.arange(self.groups, device=idx.device), idx]

    def decode(self, idx: torch.Tensor) -> torch.Tensor:
        """indices [N, G, R] -> z_hat [N, r] from the shared codebooks."""
        parts = sum(self._lookup(self.shared[:, t], idx[..., t]) for t in range(self.rounds))
        return parts.reshape(idx.shape[0], -1)

    @torch.no_grad()
    def learn(self, z: torch.Tensor) -> None:
        """One EMA k-means step of the learning codebooks on the residuals of z (sender only)."""
        residual = z.detach().float().view(z.shape[0], self.groups, -1)
        for t in range(self.rounds):
            idx = self._nearest(residual, self.learning[:, t], "learn")
            onehot = torch.nn.functional.one_hot(idx, self.size).float()  # [N, G, K]
            self.ema_count[:, t].mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
            self.ema_sum[:, t].mul_(self.decay).add_(torch.einsum("ngk,ngw->gkw", onehot, residual),
                                                     alpha=1 - self.decay)
            n = self.ema_count[:, t].sum(-1, keepdim=True)
            count = (self.ema_count[:, t] + 1e-5) / (n + self.size * 1e-5) * n  # Laplace smoothing
            self.learning[:, t].copy_(self.ema_sum[:, t] / count.unsqueeze(-1))
            self.learning[:, t, -1] = 0  # the zero codeword stays
            residual = residual - self._lookup(self.learning[:, t], idx)

    def next_stream(self) -> Tuple[int, torch.Tensor]:
        """(row j, learning[:, :, j]) to send with this micro-batch."""
        j = int(self.stream_row)
        return j, self.learning[:, :, j].clone()

    @torch.no_grad()
    def apply_stream(self, j: int, rows: torch.Tensor) -> None:
        self.shared[:, :, j].copy_(rows.view_as(self.shared[:, :, j]))
        self.stream_row.fill_((j + 1) % self.size)


# -- the wire ---------------------------------------------------------------------------------------------
class WireLayout:
    """Columns of the wire [tokens, width] in the wire dtype (e bytes each; int32 words bit-cast take 4 / e
    columns): index words, then the streamed codebook row (its number as an int32, then its R r values in the
    wire dtype) spread over every token's side columns (the forward payload: `forward` columns); the quantised
    gradient words in the first `grad_cols` columns backward; width = the larger of the two."""

    def __init__(self, tokens: int, width: int, q: ResidualQuantizer, grad_bits: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype.itemsize not in (2, 4):
            raise ValueError(f"an RVQ wire is bf16/fp16 or fp32, got {dtype}")
        self.tokens, self.r, self.grad_bits, self.dtype = tokens, width, grad_bits, dtype
        self.per_word = 4 // dtype.itemsize  # columns of one int32 word
        self.bits = index_bits(q.size)
        self.index_cols = words_for(q.groups * q.rounds, self.bits) * self.per_word
        self.stream_cols = self.per_word + q.shared[:, :, 0].numel()  # row number + one row of every codebook
        self.side = math.ceil(self.stream_cols / tokens)
        self.forward = self.index_cols + self.side
        self.grad_cols = (words_for(width, grad_bits) + 1) * self.per_word  # codes + the fp32 scale
        self.width = max(self.forward, self.grad_cols)


def _words(cols: torch.Tensor) -> torch.Tensor:
    """Wire columns [..., n] -> the int32 words they hold [..., n * itemsize / 4]."""
    return cols.contiguous().view(torch.int32)


class _ToWire(torch.autograd.Function):
    """Forward: the precomputed wire. Backward: the quantised gradient words -> dL/dZ (straight-through)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, wire: torch.Tensor, layout: WireLayout) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape = layout, z.shape
        return wire.clone()

    @staticmethod
    def backward(ctx, grad_wire: torch.Tensor):  # type: ignore[override]
        lay = ctx.layout
        words = _words(grad_wire.reshape(lay.tokens, lay.width)[:, :lay.grad_cols])
        return dequantise_gradient(words, lay.grad_bits, lay.r).view(ctx.shape), None, None


class _FromWire(torch.autograd.Function):
    """Forward: the decoded Z_hat. Backward: dL/dZ_hat quantised into wire-shaped words."""

    @staticmethod
    def forward(ctx, wire: torch.Tensor, z_hat: torch.Tensor,
                layout: WireLayout) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape = layout, wire.shape
        return z_hat.clone()

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):  # type: ignore[override]
        lay = ctx.layout
        out = torch.zeros(lay.tokens, lay.width, dtype=lay.dtype, device=grad_z.device)
        out[:, :lay.grad_cols] = quantise_gradient(grad_z.reshape(lay.tokens, lay.r), lay.grad_bits).view(lay.dtype)
        return out.view(ctx.shape), None, None


def encode_to_wire(q: ResidualQuantizer, z: torch.Tensor, grad_bits: int, learn: bool,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """z [b, s, r] -> wire [b, s, width] in `dtype` (the run's wire dtype); advances the codebook stream (and
    learns, if asked). The streamed row crosses in `dtype`: the sender's shared codebook takes the row as it
    crosses, so both sides' shared codebooks stay bit-identical."""
    b, s, r = z.shape
    flat = z.reshape(b * s, r)
    lay = WireLayout(b * s, r, q, grad_bits, dtype)
    idx = q.encode(flat)
    if learn:
        q.learn(flat)
    j, rows = q.next_stream()
    rows = rows.to(dtype)
    q.apply_stream(j, rows.float())
    wire = torch.zeros(b * s, lay.width, dtype=dtype, device=z.device)
    wire[:, :lay.index_cols] = pack_words(idx.reshape(b * s, -1), lay.bits).view(dtype)
    side = torch.zeros(b * s * lay.side, dtype=dtype, device=z.device)
    side[:lay.per_word] = torch.tensor([j], dtype=torch.int32, device=z.device).view(dtype)
    side[lay.per_word:lay.stream_cols] = rows.reshape(-1)
    wire[:, lay.index_cols:lay.forward] = side.view(b * s, lay.side)
    out = _ToWire.apply(z, wire.view(b, s, lay.width), lay)
    return mark_forward_columns(out, lay.forward)  # the gradient's extra columns are not sent forward


def decode_from_wire(q: ResidualQuantizer, wire: torch.Tensor, width: int, grad_bits: int) -> torch.Tensor:
    """wire [b, s, W] -> fp32 Z_hat [b, s, r] (decoded with the shared codebooks, then the stream applied)."""
    b, s, _ = wire.shape
    lay = WireLayout(b * s, width, q, grad_bits, wire.dtype)
    cols = wire.detach().reshape(b * s, lay.width)
    idx = unpack_words(_words(cols[:, :lay.index_cols]), lay.bits, q.groups * q.rounds)
    z_hat = q.decode(idx.view(b * s, q.groups, q.rounds)).view(b, s, width)
    side = cols[:, lay.index_cols:lay.forward].reshape(-1)
    q.apply_stream(int(_words(side[:lay.per_word])), side[lay.per_word:lay.stream_cols].float())
    return _FromWire.apply(wire, z_hat, lay)
