"""SparseLoCo's pseudo-gradient compressor: chunking, per-chunk top-k with error feedback, optional
n-bit value quantisation, and compact index packing ("Heterogeneous Low-Bandwidth Pre-Training of
LLMs", sec. 2; the chunking and packing follow the public SparseLoCo code).

Chunking. A 2-D tensor is tiled into `a x b` blocks, a 1-D (or >2-D, flattened) tensor into runs of
`n` elements, where `a`/`b` is the largest divisor of the dimension that is <= sqrt(chunk) (64 for
chunk 4096) and `n` the largest divisor of the element count <= chunk. Divisors (not padding) keep
every chunk full, as the public code's "smaller split" does; a dimension with no good divisor gives
small chunks (then `k` is clamped to the chunk size and the density rises: see `ChunkSpec.k`).

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
bits, little-endian within a byte stream (12 bits: two indices in three bytes).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

import torch

VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of `n` that is <= `cap` (>= 1)."""
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """How one tensor is cut into chunks, and how many entries each chunk keeps."""

    shape: Tuple[int, ...]
    tile: Tuple[int, ...]  # (a, b) for 2-D tiles, (n,) for runs
    topk: int

    @property
    def chunk_size(self) -> int:
        return math.prod(self.tile)

    @property
    def n_chunks(self) -> int:
        return math.prod(self.shape) // self.chunk_size

    @property
    def k(self) -> int:
        """Entries kept per chunk (top-k clamped to the chunk size)."""
        return min(self.topk, self.chunk_size)

    @property
    def n_kept(self) -> int:
        return self.n_chunks * self.k


def chunk_spec(shape: Sequence[int], chunk: int, topk: int) -> ChunkSpec:
    """Tiles of at most sqrt(chunk) x sqrt(chunk) for 2-D tensors, runs of at most `chunk` otherwise."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        side = math.isqrt(chunk)
        tile = (largest_divisor_at_most(shape[0], side), largest_divisor_at_most(shape[1], side))
        return ChunkSpec(shape, tile, topk)
    return ChunkSpec(shape, (largest_divisor_at_most(math.prod(shape), chunk),), topk)


def to_chunks(t: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """[n_chunks, chunk_size] view (2-D: row-major tiles, each tile row-major)."""
    if len(spec.tile) == 2:
        (r, c), (a, b) = spec.shape, spec.tile
        return t.reshape(r // a, a, c // b, b).permute(0, 2, 1, 3).reshape(-1, a * b)
    return t.reshape(-1, spec.tile[0])


def from_chunks(chunks: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Inverse of `to_chunks`."""
    if len(spec.tile) == 2:
        (r, c), (a, b) = spec.shape, spec.tile
        return chunks.reshape(r // a, c // b, a, b).permute(0, 2, 1, 3).reshape(spec.shape)
    return chunks.reshape(spec.shape)


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


# -- bit packing --------------------------------------------------------------------------------------
def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2**bits -> uint8 stream of ceil(n * bits / 8) bytes (little-endian bits)."""
    x = x.reshape(-1).long()
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= 2**bits):
        raise ValueError(f"values must lie in [0, 2**{bits})")
    stream = ((x.unsqueeze(1) >> torch.arange(bits, device=x.device)) & 1).to(torch.uint8).reshape(-1)
    pad = (-stream.numel()) % 8
    stream = torch.cat([stream, stream.new_zeros(pad)]).reshape(-1, 8).long()
    return (stream << torch.arange(8, device=x.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `n` integers (int64)."""
    stream = ((packed.long().unsqueeze(1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)[: n * bits]
    return (stream.reshape(n, bits) << torch.arange(bits, device=packed.device)).sum(dim=1)


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


def densify(indices: torch.Tensor, values: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Sparse chunks -> a dense tensor of `spec.shape` (zeros where nothing was sent)."""
    dense = torch.zeros(spec.n_chunks, spec.chunk_size, dtype=torch.float32, device=values.device)
    dense.scatter_(1, indices, values.reshape(indices.shape).float())
    return from_chunks(dense, spec)


# -- the payload: everything one replica sends in one outer sync, as one uint8 tensor -----------------
def payload_nbytes(specs: Sequence[ChunkSpec], index_bits: int, quant_bits: int = 0, value_dtype: str = "fp32") -> int:
    """Closed form of `encode_payload`'s size: packed indices + values (or codes + tables)."""
    n = sum(s.n_kept for s in specs)
    if quant_bits:
        values = packed_nbytes(n, quant_bits) + len(specs) * 4 * 2**quant_bits
    else:
        values = n * VALUE_DTYPES[value_dtype].itemsize
    return packed_nbytes(n, index_bits) + values


def encode_payload(parts: Sequence[Compressed], index_bits: int, quant_bits: int = 0) -> torch.Tensor:
    """[packed indices of all tensors | values or packed codes | lookup tables] as one uint8 tensor."""
    pieces = [pack_bits(torch.cat([p.indices.reshape(-1) for p in parts]), index_bits)]
    if quant_bits:
        pieces.append(pack_bits(torch.cat([p.wire_values for p in parts]), quant_bits))
        pieces += [p.table.float().view(torch.uint8) for p in parts]
    else:
        pieces += [p.wire_values.contiguous().view(torch.uint8) for p in parts]
    return torch.cat(pieces)


def decode_payload(
    payload: torch.Tensor, specs: Sequence[ChunkSpec], index_bits: int, quant_bits: int = 0, value_dtype: str = "fp32"
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of `encode_payload`: per tensor (indices [n_chunks, k], fp32 values [n_chunks, k])."""
    counts = [s.n_kept for s in specs]
    n = sum(counts)
    at = packed_nbytes(n, index_bits)
    all_idx = unpack_bits(payload[:at], index_bits, n).split(counts)
    if quant_bits:
        nb = packed_nbytes(n, quant_bits)
        all_vals = list(unpack_bits(payload[at:at + nb], quant_bits, n).split(counts))
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
