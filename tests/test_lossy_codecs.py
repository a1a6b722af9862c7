"""Lossy boundary baselines (nanotron_ext/codecs/lossy.py): the wire's bytes equal each scheme's closed
form, its reconstruction equals a plain torch reference written here, the gradient crosses compressed
the same way, and through a PP=2 pipeline the ledger counts the closed form both ways."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist import run_distributed

B, S, D = 2, 6, 32


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


def _schemes():
    from nanotron_ext.codecs.lossy import LowRank, Quantise, TopK

    return {"topk": TopK(D, 8.0), "int8": Quantise(D, 8), "int4": Quantise(D, 4), "lowrank": LowRank(D, 8.0)}


def _closed_form_width(name: str) -> int:
    return {"topk": 2 * round(D / 16), "int8": D // 4 + 1, "int4": D // 8 + 1,
            "lowrank": D // 8 + math.ceil(D * (D // 8) / (B * S))}[name]


def _reference(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "topk":
        k = round(D / 16)
        mask = torch.zeros_like(x, dtype=torch.bool).scatter(-1, x.abs().topk(k, dim=-1).indices, True)
        return torch.where(mask, x, torch.zeros_like(x))
    if name in ("int8", "int4"):
        levels = 127 if name == "int8" else 7
        scale = x.abs().amax(-1, keepdim=True) / levels
        return torch.round(x / scale).clamp(-levels, levels) * scale
    raise KeyError(name)


@pytest.mark.parametrize("name", ["topk", "int8", "int4", "lowrank"])
def test_bytes_match_the_closed_form_and_reconstruction_the_reference(name: str) -> None:
    scheme = _schemes()[name]
    x = _x()
    wire = scheme.compress(x)
    assert wire.dtype == torch.float32 and wire.shape == (B, S, _closed_form_width(name))
    assert wire.numel() * wire.element_size() == B * S * _closed_form_width(name) * 4
    back = scheme.decompress(wire, D)
    if name == "lowrank":  # Eckart-Young: the best rank-q error is the tail of the singular values
        q = D // 8
        tail = torch.linalg.svdvals(x.reshape(B * S, D).double())[q:].square().sum()
        err = (back - x).reshape(B * S, D).double().square().sum()
        torch.testing.assert_close(err, tail, rtol=1e-4, atol=1e-6)
    else:
        torch.testing.assert_close(back, _reference(name, x), rtol=1e-6, atol=1e-6)
    assert (back - x).norm() / x.norm() > 1e-3  # lossy, as the comparison needs


def test_int4_codes_travel_two_per_byte_low_nibble_first() -> None:
    from nanotron_ext.codecs.lossy import Quantise

    x = _x()
    codes = torch.round(x / (x.abs().amax(-1, keepdim=True) / 7)).clamp(-7, 7).to(torch.int64) + 7  # 0..14
    expected = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    wire = Quantise(D, 4).compress(x)
    assert torch.equal(wire[..., :-1].contiguous().view(torch.uint8), expected)


@pytest.mark.parametrize("name", ["topk", "int8", "int4", "lowrank"])
def test_the_gradient_crosses_compressed_by_the_same_scheme(name: str) -> None:
    from nanotron_ext.codecs.lossy import LossyDecoder, LossyEncoder

    scheme = _schemes()[name]
    x = _x(1).requires_grad_()
    wire = LossyEncoder(scheme)(x, torch.zeros_like(x), None)
    sent = wire.detach().requires_grad_()  # what the receiving stage gets
    rebuilt, hidden = LossyDecoder(scheme, D)(sent, None)
    g = _x(2)
    rebuilt.backward(g)
    assert sent.grad.shape == wire.shape  # the gradient wire has the forward wire's layout and bytes
    wire.backward(sent.grad)
    torch.testing.assert_close(x.grad, scheme.decompress(scheme.compress(g), D))
    if name != "lowrank":
        torch.testing.assert_close(x.grad, _reference(name, g), rtol=1e-6, atol=1e-6)


def _pp2_worker(kind: str) -> dict:
    from tests.test_extension_points import _run_model

    return _run_model(2, "1f1b", {"codec": {"kind": kind, "boundaries": "stages"}})


@pytest.mark.slow
def test_int8_through_pp2_counts_the_closed_form_both_ways() -> None:
    from tests.test_extension_points import MB, MODEL, N_MICRO, SEQ

    sender, receiver = run_distributed(_pp2_worker, 2, "int8")
    per_micro = MB * SEQ * (MODEL["hidden_size"] // 4 + 1) * 4
    assert sender["comm"]["pp"]["send:fwd"]["bytes"] == N_MICRO * per_micro
    assert receiver["comm"]["pp"]["send:bwd"]["bytes"] == N_MICRO * per_micro
    assert math.isfinite(sender["loss"])


@pytest.mark.parametrize("autocast", [False, True])
def test_lowrank_is_the_float64_truncated_svd(autocast: bool) -> None:
    """With a spectral gap at q the best rank-q approximation is unique: the codec's reconstruction equals the
    float64 truncated SVD U_q S_q V_q^T (its basis comes from the Gram matrix's eigenvectors, not an SVD), also
    under bf16 autocast (the codec computes in fp32 there: only the wire is bf16)."""
    from nanotron_ext.codecs.lossy import LowRank

    n, d, q = 96, 32, 4
    gen = torch.Generator().manual_seed(7)
    u = torch.linalg.qr(torch.randn(n, d, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    s = torch.cat([torch.tensor([9.0, 7.0, 5.0, 4.0]), torch.linspace(1.0, 0.1, d - q)]).double()
    x = (u * s) @ v.T
    us, ss, vh = torch.linalg.svd(x, full_matrices=False)
    reference = (us[:, :q] * ss[:q]) @ vh[:q]
    scheme = LowRank(d, d / q)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        wire = scheme.compress(x.float().view(1, n, d))
    assert wire.dtype == torch.float32  # the scheme's wire dtype, not autocast's
    back = scheme.decompress(wire, d).view(n, d).double()
    torch.testing.assert_close(back, reference, rtol=0, atol=1e-5 * float(s[0]))
