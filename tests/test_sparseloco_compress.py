"""SparseLoCo's compressor against plain-torch / plain-Python references written here: chunking into
64 x 64 tiles and runs of at most 4096 (ragged tensors zero-padded, so awkward shapes keep the configured
density), exactly k kept per chunk, the error-feedback identity, 12-bit index packing, the n-bit quantiser,
and the payload's closed-form size."""
from __future__ import annotations

import pytest
import torch

from nanotron_ext.codecs.bitpack import pack_stream, unpack_stream
from nanotron_ext.sparseloco.compress import (
    chunk_spec,
    compress_with_feedback_,
    decode_payload,
    encode_payload,
    from_chunks,
    payload_nbytes,
    quantize,
    to_chunks,
)
from tests.helpers.references import densify


def _tiles_reference(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Tiles by explicit slicing, row-major over tiles, each tile flattened row-major."""
    rows = []
    for i in range(0, t.shape[0], a):
        for j in range(0, t.shape[1], b):
            rows.append(t[i:i + a, j:j + b].reshape(-1))
    return torch.stack(rows)


def test_chunking_tiles_2d_and_runs_1d() -> None:
    t = torch.randn(128, 192)
    spec = chunk_spec(t.shape, 4096, 32)
    assert spec.tile == (64, 64) and spec.n_chunks == 6 and spec.chunk_size == 4096
    assert torch.equal(to_chunks(t, spec), _tiles_reference(t, 64, 64))
    assert torch.equal(from_chunks(to_chunks(t, spec), spec), t)
    v = torch.randn(3 * 4096)
    s1 = chunk_spec(v.shape, 4096, 32)
    assert s1.tile == (4096,) and torch.equal(to_chunks(v, s1), v.reshape(3, 4096))
    # a 2-D tensor with a dimension 64 does not divide: equal runs over the flattened tensor (no tiles)
    s2 = chunk_spec((96, 100), 4096, 32)
    assert s2.tile == (3200,) and s2.n_chunks == 3 and s2.padding == 0
    assert torch.equal(to_chunks(torch.arange(9600.).reshape(96, 100), s2), torch.arange(9600.).reshape(3, 3200))


def _runs_reference(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """ceil(numel / chunk) equal runs of the flattened tensor, the last one zero-padded (Python slicing)."""
    flat = t.reshape(-1).tolist()
    n = -(-len(flat) // chunk)
    run = -(-len(flat) // n)
    return torch.tensor([(flat[i * run:(i + 1) * run] + [0.0] * run)[:run] for i in range(n)])


@pytest.mark.parametrize("shape,chunks", [((10007,), 3), ((257, 96), 7), ((1536, 4103), 1539), ((3, 5, 7), 1)])
def test_ragged_tensors_are_padded_to_whole_chunks_at_the_configured_density(shape: tuple, chunks: int) -> None:
    """The issue's shapes: the public code's largest-divisor rule gives them chunk 1 (100%), 67% and 4.5%;
    padded runs keep every chunk near 4096 elements, so the density stays within 1.25x of 32 / 4096."""
    spec = chunk_spec(shape, 4096, 32)
    numel = 1
    for n in shape:
        numel *= n
    assert spec.n_chunks == chunks and spec.chunk_size <= 4096 and 0 <= spec.padding < chunks
    assert spec.density == chunks * min(32, spec.chunk_size) / numel
    if numel >= 4096:
        assert spec.density <= 1.25 * 32 / 4096
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if numel < 10**5:
        assert torch.equal(to_chunks(t, spec), _runs_reference(t, 4096))
    assert torch.equal(from_chunks(to_chunks(t, spec), spec), t)
    # error feedback on a padded tensor: k real entries per chunk, e + sent == acc bit for bit
    e, delta = torch.zeros(shape), t
    c = compress_with_feedback_(e, delta, spec, 0.95, 0, "fp32")
    sent = densify(c.indices, c.transmitted, spec)
    assert sent.shape == t.shape and torch.equal(e + sent, delta)
    assert int((sent != 0).sum()) == spec.n_kept


def test_density_warning_names_the_dense_tensors() -> None:
    from nanotron_ext.sparseloco.compress import density_warning

    big, small = chunk_spec((4096, 64), 4096, 32), chunk_spec((64,), 4096, 32)
    assert density_warning(["w", "norm"], [big, small], 4096, 32) is None  # 2080 kept of 262208: 0.79%
    msg = density_warning(["w", "norm", "bias"], [chunk_spec((64, 64), 4096, 32), small, small], 4096, 32)
    assert msg is not None and "sparseloco.topk=32" in msg and "norm (64,) 50.00%" in msg and "w (" not in msg


@pytest.mark.parametrize("quant_bits,value_dtype", [(0, "fp32"), (0, "bf16"), (2, "fp32")])
def test_exactly_k_per_chunk_and_error_feedback_identity(quant_bits: int, value_dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    shape, beta, k = (128, 128), 0.95, 32
    spec = chunk_spec(shape, 4096, k)
    e_old = torch.randn(shape, generator=g)
    delta = torch.randn(shape, generator=g)
    e = e_old.clone()
    c = compress_with_feedback_(e, delta, spec, beta, quant_bits, value_dtype)
    sent = densify(c.indices, c.transmitted, spec)
    # exactly k positions per 4096-element chunk, and they are the k largest |beta e + delta|
    acc = beta * e_old + delta
    for chunk_acc, idx in zip(_tiles_reference(acc, 64, 64), c.indices):
        assert idx.unique().numel() == k
        threshold = chunk_acc.abs().sort(descending=True).values[k - 1]
        assert bool((chunk_acc.abs()[idx] >= threshold).all())
    nonzero_per_chunk = (_tiles_reference(sent, 64, 64) != 0).sum(dim=1)
    assert bool((nonzero_per_chunk == k).all())
    if quant_bits == 0:  # Sterbenz: the kept value minus its rounding is exact, so the identity is bitwise
        assert torch.equal(e + sent, acc)
        if value_dtype == "fp32":  # sent as is: nothing of a kept entry stays behind
            assert bool((_tiles_reference(e, 64, 64).gather(1, c.indices) == 0).all())
    else:
        torch.testing.assert_close(e + sent, acc, rtol=0, atol=1e-6)
    unsent = sent == 0
    assert torch.equal(e[unsent], acc[unsent])  # what is not sent stays in the buffer untouched


def _pack_reference(values: list, bits: int) -> bytes:
    """Little-endian bit stream with plain Python integers."""
    acc = 0
    for i, v in enumerate(values):
        acc |= v << (i * bits)
    n = (len(values) * bits + 7) // 8
    return acc.to_bytes(n, "little")


@pytest.mark.parametrize("bits", [12, 2, 13])
def test_index_packing_round_trips_and_matches_reference(bits: int) -> None:
    x = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = pack_stream(x, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (1001 * bits + 7) // 8
    assert bytes(packed.tolist()) == _pack_reference(x.tolist(), bits)
    assert torch.equal(unpack_stream(packed, bits, 1001), x)
    if bits == 12:  # two indices in three bytes
        assert pack_stream(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
    with pytest.raises(ValueError):
        pack_stream(torch.tensor([2**bits]), bits)


def _quantize_reference(v: torch.Tensor, bits: int):
    """Per-bin mean lookup over 2**bits equal-width bins on [min, max], written with a Python loop."""
    levels = 2**bits
    lo, hi = float(v.min()), float(v.max())
    width = (hi - lo) / levels
    out = torch.empty_like(v)
    for j in range(levels):
        left = lo + j * width
        in_bin = (v >= left) & (v < left + width) if j < levels - 1 else v >= left
        if in_bin.any():
            out[in_bin] = v[in_bin].mean()
    return out


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_quantised_values_match_reference(bits: int) -> None:
    v = torch.randn(4000, generator=torch.Generator().manual_seed(bits)).to(torch.float64).float()
    codes, table = quantize(v, bits)
    assert codes.min() >= 0 and codes.max() < 2**bits and table.numel() == 2**bits
    torch.testing.assert_close(table[codes], _quantize_reference(v, bits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quant_bits,value_dtype", [(0, "fp32"), (0, "bf16"), (2, "fp32")])
def test_payload_round_trip_and_closed_form_size(quant_bits: int, value_dtype: str) -> None:
    g = torch.Generator().manual_seed(1)
    shapes = [(128, 64), (64,), (4096 * 2,), (96, 100)]
    specs = [chunk_spec(s, 4096, 32) for s in shapes]
    parts = [compress_with_feedback_(torch.zeros(s), torch.randn(s, generator=g), sp, 0.95, quant_bits, value_dtype)
             for s, sp in zip(shapes, specs)]
    payload = encode_payload(parts, specs, 12, quant_bits)
    n = 2 * 32 + 32 + 2 * 32 + 3 * 32  # two tiles, one run of 64 (k = 32), two runs, three runs of 3200
    values = (n * quant_bits + 7) // 8 + 4 * 4 * 2**quant_bits if quant_bits else n * {"fp32": 4,
                                                                                       "bf16": 2}[value_dtype]
    assert payload.numel() == payload_nbytes(specs, 12, quant_bits, value_dtype) == (n * 12 + 7) // 8 + values
    for (idx, val), part in zip(decode_payload(payload, specs, 12, quant_bits, value_dtype), parts):
        assert torch.equal(idx, part.indices) and torch.equal(val, part.transmitted)


def test_whole_chunks_send_their_values_in_position_order_and_no_index() -> None:
    """top-k = the chunk (dense DiLoCo's outer loop) and tensors of at most top-k elements: every position is sent,
    so the payload is the values alone (and the indices of the other tensors); decoding rebuilds the positions."""
    g = torch.Generator().manual_seed(2)
    shapes = [(128, 64), (20,), (300,)]
    specs = [chunk_spec(s, 4096, 4096) for s in shapes] + [chunk_spec((8,), 4096, 32), chunk_spec((64,), 4096, 32)]
    shapes += [(8,), (64,)]
    assert [s.whole for s in specs] == [True, True, True, True, False]
    parts = [compress_with_feedback_(torch.zeros(s), torch.randn(s, generator=g), sp, 0.95, 0, "bf16")
             for s, sp in zip(shapes, specs)]
    payload = encode_payload(parts, specs, 12)
    whole_values = 128 * 64 + 20 + 300 + 8
    assert payload.numel() == payload_nbytes(specs, 12, 0, "bf16") == (32 * 12 + 7) // 8 + 2 * (whole_values + 32)
    for (idx, val), part, spec in zip(decode_payload(payload, specs, 12, 0, "bf16"), parts, specs):
        assert torch.equal(idx, part.indices) and torch.equal(val, part.transmitted)
        if spec.whole:
            assert torch.equal(idx, torch.arange(spec.k).expand(spec.n_chunks, spec.k))
