"""SparseLoCo's pseudo-gradient compressor: chunking, per-chunk top-k with error feedback, optional
n-bit value quantisation, and compact index packing ("Heterogeneous Low-Bandwidth Pre-Training of
LLMs", sec. 2; the chunking and packing follow the public SparseLoCo code).

Chunking. A 2-D tensor whose two dimensions are multiples of sqrt(chunk) (64 for chunk 4096) is tiled
into 64 x 64 blocks, as in the paper ("a chunk size of 64 x 64"). Every other tensor (1-D, >2-D, or a
2-D one with a ragged dimension) is flattened row-major and cut into n = ceil(numel / chunk) runs of
equal length ceil(numel / n) <= chunk, the last one zero-padded (fewer than n padded elements), so
every chunk keeps k of about `chunk` real elements and the density stays near k / chunk. The public
SparseLoCo code instead shrinks the tile to the largest divisor of the dimension (no padding): that
silently raises the density for awkward shapes (a 10007-element tensor gets chunk 1, 100%; (257, 96)
67%; (1536, 4103) 4.5%), so it is not followed here. A tensor smaller than one chunk is one chunk.
`ChunkSpec.density` is each tensor's effective density; `density_warning` names the tensors of a run
whose overall density exceeds twice the configured k / chunk (small tensors, e.g. norm weights, keep
k of fewer than `chunk` elements).

Error feedback (per chunk): `acc = beta * e + delta`; keep the k entries of `acc` largest in
magnitude; `transmitted` = those entries after value rounding (bf16) or quantisation; `e_new =
acc - transmitted` on the kept positions, `acc` elsewhere. Without quantisation the kept entry and its
rounding are within a factor 2 of each other, so `acc - t` is exact (Sterbenz) and
`e_new + transmitted == acc` holds bit for bit; with quantisation it holds up to one rounding.

Quantiser (n bits, one per parameter tensor per sync): `2**n` equal-width bins over
[min, max] of the kept values; a value's code is its bin; the receiver looks the code up in a table
holding the mean of the kept values that fell in each bin (bin centre for an empty bin). The codes
(n bits each) and the table (`2**n` fp32) are sent. This is the public code's "per-bin mean lookup
table" idea; its exact binning (centring, scaling) is not stated in the paper, so this is our choice.

Index packing: every index (position inside its chunk, < chunk size) is written with `index_bits`
bits, little-endian within a byte stream (12 bits: two indices in three bytes; nanotron_ext.codecs.bitpack's
dense stream).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import torch

from nanotron_ext.codecs.bitpack import pack_stream, stream_nbytes, unpack_stream

VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """How one tensor is cut into chunks, and how many entries each chunk keeps."""

    shape: Tuple[int, ...]
    tile: Tuple[int, ...]  # (a, b) for 2-D tiles, (n,) for runs (the last one zero-padded)
    topk: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk_size(self) -> int:
        return math.prod(self.tile)

    @property
    def n_chunks(self) -> int:
        return math.ceil(self.numel / self.chunk_size)

    @property
    def padding(self) -> int:
        """Zero elements appended to the last run (0 for tiles)."""
        return self.n_chunks * self.chunk_size - self.numel

    @property
    def k(self) -> int:
        """Entries kept per chunk (top-k clamped to the chunk size)."""
        return min(self.topk, self.chunk_size)

    @property
    def n_kept(self) -> int:
        return self.n_chunks * self.k

    @property
    def whole(self) -> bool:
        """Every entry of every chunk is kept: the indices are 0..chunk_size-1 in order, so none are sent (top-k =
        the chunk makes the outer loop DiLoCo's dense one, with error feedback only for the value rounding)."""
        return self.k == self.chunk_size

    @property
    def n_indexed(self) -> int:
        """Indices this tensor puts on the wire."""
        return 0 if self.whole else self.n_kept

    @property
    def density(self) -> float:
        """Share of this tensor's elements sent per sync."""
        return self.n_kept / self.numel


def chunk_spec(shape: Sequence[int], chunk: int, topk: int) -> ChunkSpec:
    """sqrt(chunk) x sqrt(chunk) tiles when both dimensions of a 2-D tensor are multiples of the side,
    else equal runs of at most `chunk` elements over the flattened tensor (module docstring)."""
    shape = tuple(int(s) for s in shape)
    side = math.isqrt(chunk)
    if len(shape) == 2 and shape[0] % side == 0 and shape[1] % side == 0:
        return ChunkSpec(shape, (side, side), topk)
    numel = math.prod(shape)
    runs = max(1, math.ceil(numel / chunk))
    return ChunkSpec(shape, (math.ceil(numel / runs),), topk)


def density_warning(names: Sequence[str], specs: Sequence[ChunkSpec], chunk: int, topk: int) -> Optional[str]:
    """A message when the overall density (kept / elements over all tensors) exceeds 2 x topk / chunk,
    naming the tensors above it; None otherwise."""
    configured = topk / chunk
    overall = sum(s.n_kept for s in specs) / max(1, sum(s.numel for s in specs))
    if overall <= 2 * configured:
        return None
    worst = sorted(((s.density, n, s) for n, s in zip(names, specs) if s.density > 2 * configured), reverse=True)
    listed = ", ".join(f"{n} {tuple(s.shape)} {d:.2%}" for d, n, s in worst[:8])
    return (f"sparseloco: overall density {overall:.2%} is above twice the configured {configured:.2%} "
            f"(sparseloco.topk={topk} of sparseloco.chunk={chunk}): {len(worst)} tensors are denser, e.g. {listed}")


def to_chunks(t: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """[n_chunks, chunk_size] (2-D tiles: row-major tiles, each tile row-major; runs: zero-padded at the end)."""
    if len(spec.tile) == 2:
        (r, c), (a, b) = spec.shape, spec.tile
        return t.reshape(r // a, a, c // b, b).permute(0, 2, 1, 3).reshape(-1, a * b)
    return torch.nn.functional.pad(t.reshape(-1), (0, spec.padding)).reshape(spec.n_chunks, spec.chunk_size)


def from_chunks(chunks: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Inverse of `to_chunks` (the padding dropped)."""
    if len(spec.tile) == 2:
        (r, c), (a, b) = spec.shape, spec.tile
        return chunks.reshape(r // a, c // b, a, b).permute(0, 2, 1, 3).reshape(spec.shape)
    return chunks.reshape(-1)[:spec.numel].reshape(spec.shape)


def topk_indices(chunks: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest magnitudes in each row, sorted ascending (a canonical order)."""
    return torch.topk(chunks.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values


# -- quantisation -------------------------------------------------------------------------------------
def quantize(values: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes int64 in [0, 2**bits), table fp32 [2**bits]) for a flat tensor: see the module docstring."""
    levels = 2**bits
    v = values.float().reshape(-1)
    lo, hi = v.min(), v.max()
    width = (hi - lo) / levels
    if float(width) > 0:
        codes = ((v - lo) / width).floor().clamp_(0, levels - 1).long()
    else:  # all kept values equal: one bin
        codes = torch.zeros_like(v, dtype=torch.long)
    sums = torch.zeros(levels, dtype=torch.float32, device=v.device).index_add_(0, codes, v)
    counts = torch.bincount(codes, minlength=levels).float()
    centres = lo + (torch.arange(levels, dtype=torch.float32, device=v.device) + 0.5) * width
    table = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    return codes, table


def dequantize(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes]


# -- one tensor's compression step ----------------------------------------------------------------------
@dataclasses.dataclass
class Compressed:
    """What one replica sends for one tensor, and what the receivers reconstruct from it."""

    indices: torch.Tensor  # [n_chunks, k] int64, position inside the chunk
    wire_values: torch.Tensor  # [n_chunks * k] in value_dtype, or int64 codes when quantised
    table: torch.Tensor  # [2**bits] fp32 lookup table, empty without quantisation
    transmitted: torch.Tensor  # [n_chunks, k] fp32: the values every receiver decodes


def compress_with_feedback_(
    error: torch.Tensor, delta: torch.Tensor, spec: ChunkSpec, beta: float, quant_bits: int = 0,
    value_dtype: str = "fp32",
) -> Compressed:
    """Error feedback + top-k + rounding/quantisation for one tensor; updates `error` in place to
    `beta * error + delta - transmitted` (see the module docstring)."""
    acc = to_chunks(error.mul(beta).add(delta), spec).contiguous()
    idx = topk_indices(acc, spec.k)
    kept = acc.gather(1, idx)
    if quant_bits:
        codes, table = quantize(kept, quant_bits)
        transmitted = dequantize(codes, table).reshape(kept.shape)
        wire = codes
    else:
        wire = kept.to(VALUE_DTYPES[value_dtype]).reshape(-1)
        transmitted = wire.float().reshape(kept.shape)
        table = torch.empty(0, device=kept.device)
    acc.scatter_(1, idx, kept - transmitted)
    error.copy_(from_chunks(acc, spec))
    return Compressed(idx, wire, table, transmitted)


# -- the payload: everything one replica sends in one outer sync, as one uint8 tensor -----------------
def payload_nbytes(specs: Sequence[ChunkSpec], index_bits: int, quant_bits: int = 0, value_dtype: str = "fp32") -> int:
    """Closed form of `encode_payload`'s size: packed indices (of the tensors not kept whole) + values (or codes +
    tables)."""
    n = sum(s.n_kept for s in specs)
    if quant_bits:
        values = stream_nbytes(n, quant_bits) + len(specs) * 4 * 2**quant_bits
    else:
        values = n * VALUE_DTYPES[value_dtype].itemsize
    return stream_nbytes(sum(s.n_indexed for s in specs), index_bits) + values


def encode_payload(parts: Sequence[Compressed], specs: Sequence[ChunkSpec], index_bits: int,
                   quant_bits: int = 0) -> torch.Tensor:
    """[packed indices of the tensors not kept whole | values or packed codes | lookup tables] as one uint8
    tensor (a whole tensor's values are in position order: topk_indices sorts them)."""
    indexed = [p.indices.reshape(-1) for p, s in zip(parts, specs) if not s.whole]
    empty = torch.empty(0, dtype=torch.long, device=parts[0].indices.device) if parts else torch.empty(0)
    pieces = [pack_stream(torch.cat(indexed) if indexed else empty, index_bits)]
    if quant_bits:
        pieces.append(pack_stream(torch.cat([p.wire_values for p in parts]), quant_bits))
        pieces += [p.table.float().view(torch.uint8) for p in parts]
    else:
        pieces += [p.wire_values.contiguous().view(torch.uint8) for p in parts]
    return torch.cat(pieces)


def decode_payload(
    payload: torch.Tensor, specs: Sequence[ChunkSpec], index_bits: int, quant_bits: int = 0, value_dtype: str = "fp32"
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of `encode_payload`: per tensor (indices [n_chunks, k], fp32 values [n_chunks, k])."""
    counts = [s.n_kept for s in specs]
    n, n_indexed = sum(counts), sum(s.n_indexed for s in specs)
    at = stream_nbytes(n_indexed, index_bits)
    sent = iter(unpack_stream(payload[:at], index_bits, n_indexed).split([s.n_kept for s in specs if not s.whole]))
    all_idx = [torch.arange(s.k, device=payload.device).repeat(s.n_chunks) if s.whole else next(sent) for s in specs]
    if quant_bits:
        nb = stream_nbytes(n, quant_bits)
        all_vals = list(unpack_stream(payload[at:at + nb], quant_bits, n).split(counts))
        at += nb
        tsize = 4 * 2**quant_bits
        for i in range(len(specs)):
            table = payload[at + i * tsize: at + (i + 1) * tsize].clone().view(torch.float32)
            all_vals[i] = dequantize(all_vals[i], table)
    else:
        dt = VALUE_DTYPES[value_dtype]
        all_vals = []
        for c in counts:
            nbytes = c * dt.itemsize
            all_vals.append(payload[at:at + nbytes].clone().view(dt).float())
            at += nbytes
    return [(i.reshape(s.n_chunks, s.k), v.reshape(s.n_chunks, s.k)) for i, v, s in zip(all_idx, all_vals, specs)]
