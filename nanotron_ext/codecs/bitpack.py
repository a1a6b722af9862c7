"""Bit packing, the one implementation every wire uses: small non-negative integers (codes, indices) written
`bits` bits each into words of `word_bits` bits, little-endian (value j of a word in its bits j*bits ..
(j+1)*bits - 1).

- `pack_words` / `unpack_words`: along the last dimension, floor(word_bits / bits) values per word and none
  straddling two words (the spare top bits are zero). MAPL's RVQ indices and gradient codes (int32 words,
  mapl/rvq.py) and the int4 baseline's two codes per byte (codecs/lossy.py).
- `pack_stream` / `unpack_stream`: one flat, dense bit stream of ceil(n bits / 8) bytes, values straddling
  bytes (12 bits: two values in three bytes): a value's bits are 1-bit values packed into bytes, and read back
  as 1-bit values packed into a `bits`-bit word. SparseLoCo's compact indices and quantised values
  (sparseloco/compress.py).

Words of 8 bits come back as uint8, of 16 / 32 bits as int16 / int32 with the same bit pattern (the wire's
integer columns), of any other width as int64; unpacking returns int64 values unless asked for another type.
"""
from __future__ import annotations

import math

import torch

_WORD_DTYPES = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def per_word(bits: int, word_bits: int = 32) -> int:
    """Values of `bits` bits one `word_bits`-bit word holds (none straddles two words)."""
    if not 1 <= bits <= word_bits <= 62:
        raise ValueError(f"{bits}-bit values in {word_bits}-bit words: need 1 <= bits <= word_bits <= 62")
    return word_bits // bits


def words_for(count: int, bits: int, word_bits: int = 32) -> int:
    """Words of `word_bits` bits holding `count` values of `bits` bits (values never straddle two words)."""
    return math.ceil(count / per_word(bits, word_bits))


def _compute_dtype(word_bits: int) -> torch.dtype:
    """The narrowest integer type that holds a word without a sign bit (shifts and ORs run in it)."""
    return torch.uint8 if word_bits <= 8 else torch.int64


def _unsigned_words(values: torch.Tensor, bits: int, word_bits: int) -> torch.Tensor:
    """pack_words' words as non-negative integers (uint8 for words of up to 8 bits, else int64)."""
    slots = per_word(bits, word_bits)
    n = values.shape[-1]
    words = words_for(n, bits, word_bits)
    v = torch.nn.functional.pad(values.to(_compute_dtype(word_bits)), (0, words * slots - n))
    grouped = v.view(*values.shape[:-1], words, slots)
    # the values' bits do not overlap: their sum is their OR (bytes: one OR per slot, faster than a uint8 sum)
    if v.dtype != torch.uint8:
        return (grouped << (torch.arange(slots, device=v.device) * bits)).sum(-1)
    word = grouped[..., 0].clone()
    for j in range(1, slots):
        word |= grouped[..., j] << (j * bits)
    return word


def pack_words(values: torch.Tensor, bits: int, word_bits: int = 32) -> torch.Tensor:
    """Non-negative integers [..., n] (< 2**bits) -> words [..., words_for(n, bits, word_bits)]."""
    word = _unsigned_words(values, bits, word_bits)
    dtype = _WORD_DTYPES.get(word_bits, torch.int64)
    if dtype in (torch.int16, torch.int32):  # the same bit pattern as the signed word
        word = torch.where(word >= 2 ** (word_bits - 1), word - 2**word_bits, word)
    return word.to(dtype)


def unpack_words(words: torch.Tensor, bits: int, n: int, word_bits: int = 32,
                 dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of pack_words: words [..., w] -> values [..., n] as `dtype` (int64; a narrower type saves a wide
    copy of many small codes)."""
    slots = per_word(bits, word_bits)
    wide = _compute_dtype(word_bits)
    unsigned = words.view(wide) if words.dtype.itemsize == wide.itemsize else words.long() & ((1 << word_bits) - 1)
    mask = (1 << bits) - 1
    values = torch.stack([(unsigned >> (j * bits)) & mask for j in range(slots)], dim=-1)
    return values.flatten(-2)[..., :n].to(dtype)


def stream_nbytes(n: int, bits: int) -> int:
    """Bytes of the dense stream of `n` values of `bits` bits."""
    return (n * bits + 7) // 8


def pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2**bits (any shape, read flat) -> uint8 stream of stream_nbytes(n, bits) bytes."""
    x = values.reshape(-1).long()
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= 2**bits):
        raise ValueError(f"values must lie in [0, 2**{bits})")
    stream = unpack_words(x.unsqueeze(1), 1, bits, word_bits=bits).reshape(-1)  # each value's bits, lowest first
    return pack_words(stream, 1, word_bits=8)


def unpack_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_stream: the first `n` integers (int64)."""
    stream = unpack_words(packed.reshape(-1), 1, n * bits, word_bits=8, dtype=torch.uint8)
    return _unsigned_words(stream.reshape(n, bits), 1, word_bits=bits).reshape(n).long()
