"""The pipeline-boundary codec hook: a codec that needs token ids gets them on both sides of every
boundary, what it emits is what crosses the link (and is counted), and an exactly invertible
codec leaves the model's loss and gradients equal to the float64 single-process reference."""
from __future__ import annotations

from typing import Optional, Tuple

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import micro_batches, one_step, small_config
from tests.test_parallel_parity import MB, MODEL, N_MICRO, SEQ, _parity_worker


def _register_anchor_codec() -> None:
    """Sends x - anchor(ids) and the ids; the receiver adds anchor(ids) back (SM/MAPL's shape), as a
    technique registered in this worker process (nanotron_ext.config.compose.register_technique).

    The anchor is a fixed pseudo-random table, identical on both stages, so the reconstruction is
    exact and the model's numbers must not change."""
    from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder
    from nanotron_ext.config.compose import register_technique
    from nanotron_ext.technique import Pieces, Technique

    def anchor(ids: torch.Tensor, d: int) -> torch.Tensor:
        table = torch.randn(MODEL["vocab_size"], d, generator=torch.Generator().manual_seed(7))
        return table[ids]

    class Enc(BoundaryEncoder):
        def forward(self, residual, branch, input_ids) -> torch.Tensor:
            assert input_ids is not None and input_ids.dtype == torch.int64
            x = residual + branch
            return x - anchor(input_ids, x.shape[-1])

    class Dec(BoundaryDecoder):
        def forward(self, wire, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
            assert input_ids is not None
            x = wire + anchor(input_ids, wire.shape[-1])
            return x, x

    class AnchorCodec(BoundaryCodec):
        needs_token_ids = True

        def encoder(self, boundary: int) -> BoundaryEncoder:
            return Enc()

        def decoder(self, boundary: int) -> BoundaryDecoder:
            return Dec()

    class AnchorPieces(Pieces):
        def codec(self, name, strategy) -> BoundaryCodec:
            return AnchorCodec(self.cfg, self.tp_pg)

    class AnchorTechnique(Technique):
        name = "test_anchor"
        provides = {"model.codec.kind": ["test_anchor"]}
        pieces = AnchorPieces

    register_technique(AnchorTechnique())


def _anchor_worker(dp: int, tp: int, pp: int) -> dict:
    _register_anchor_codec()
    from nanotron_ext.config.schema import CodecConfig

    return _parity_worker(dp, tp, pp, "1f1b", {"codec": CodecConfig(kind="test_anchor")})


@pytest.mark.slow
def test_codec_with_token_ids_is_exact_and_ids_cross_the_link() -> None:
    results = run_distributed(_anchor_worker, 4, 1, 1, 4)
    per_micro_hidden = MB * SEQ * MODEL["hidden_size"] * 4
    per_micro_ids = MB * SEQ * 4  # int32 ids bit-cast into one fp32 column of the wire
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) / r["ref_loss"] <= 1e-5
        assert r["worst_grad_rel"] <= 1e-5, (r["worst_name"], r["worst_grad_rel"])
        pp_comm = r["comm"].get("pp", {})
        fwd = pp_comm.get("send:fwd", {}).get("bytes", 0)
        bwd = pp_comm.get("send:bwd", {}).get("bytes", 0)
        last = r["pp_rank"] == 3
        # one packed tensor each way: [delta | ids] forward, its gradient (zeros in the id column) back
        assert fwd == (0 if last else N_MICRO * (per_micro_hidden + per_micro_ids)), r["comm"]
        assert bwd == (0 if r["pp_rank"] == 0 else N_MICRO * (per_micro_hidden + per_micro_ids)), r["comm"]


def test_pack_ids_is_bit_exact_for_every_wire_dtype() -> None:
    from nanotron_ext.codecs.base import pack_ids, unpack_ids

    ids = torch.tensor([[0, 1, 2**31 - 1], [65535, 7, 123456789]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        wire = torch.randn(2, 3, 5).to(dtype).requires_grad_()
        packed = pack_ids(wire, ids)
        back, got = unpack_ids(packed)
        assert torch.equal(got, ids) and torch.equal(back, wire)
        back.sum().backward()
        assert torch.equal(wire.grad, torch.ones_like(wire))


# Wire bytes per token per direction at each compute dtype (e = element size: 4 fp32, 2 bf16), d = 32, one
# micro-batch of MB x SEQ = 16 tokens: every codec's values cross in the run's compute dtype, ids as int32.
_D = MODEL["hidden_size"]
_CODECS = {
    "identity": ({}, lambda e: _D * e),
    "resbm": ({"resbm": {"h": 8}}, lambda e: 8 * e),
    "subspace": ({}, lambda e: 4 * e + 4),  # k = d / 8
    "mapl": ({"mapl": {"rank": 8, "anchor_width": 4}}, lambda e: 8 * e + 4),
    "topk": ({"ratio": 8.0}, lambda e: 2 * (e + 4)),  # k = round(d / 16) values + int32 indices
    "int8": ({}, lambda e: _D + 4),  # codes + an fp32 scale: independent of the dtype
    "int4": ({}, lambda e: _D // 2 + 4),
    "lowrank": ({"ratio": 8.0}, lambda e: (4 + -(-_D * 4 // (MB * SEQ))) * e),  # q = 4 + the d x q basis
    # MAPL RVQ, r = 8, G = 2, R = 2, K = 16 (4 indices of 4 bits: one int32 word), 8-bit gradient, (fwd, bwd):
    # id + index word + the streamed row (an int32 row number and R r = 16 values in the wire dtype, over 16
    # tokens); back: id + the wider of that and the gradient (8 codes of 8 bits + an fp32 scale: 3 words)
    "mapl_rvq": ({"kind": "mapl", "mapl": {"rank": 8, "anchor_width": 4, "vq_groups": 2, "vq_rounds": 2,
                                           "vq_codebook": 16, "grad_bits": 8}},
                 lambda e: (4 + 4 + e * -(-(4 // e + 16) // 16), 4 + max(4 + e * -(-(4 // e + 16) // 16), 12))),
}


def _dtype_worker() -> dict:
    import torch

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from tests.test_parallel_parity import _global_batch

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    micro = micro_batches(_global_batch(1), MB, N_MICRO)
    out = {}
    for kind, (options, _) in _CODECS.items():
        for dtype in ("fp32", "bf16"):
            model_cfg = {**MODEL, "dtype": dtype, "codec": {"kind": kind, **options}}  # options may name the kind
            if kind == "subspace":
                model_cfg.update(embedding={"kind": "subspace"}, output_constraint={"kind": "subspace"})
            cfg = small_config(model_cfg, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
            model = build_model(cfg, ctx)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss, comm = one_step(model, micro, ctx)
            pp = comm.get("pp", {})
            out[kind, dtype] = {d: pp.get(f"send:{d}", {}).get("bytes", 0) / (N_MICRO * MB * SEQ)
                                for d in ("fwd", "bwd")} | {"loss": loss}
    return out


@pytest.mark.slow
def test_every_codec_sends_the_compute_dtype_both_ways() -> None:
    """Under model.dtype bf16 (autocast over fp32 weights) each codec's wire and its gradient cross in bf16
    (ResBM appendix A.3: 2 B per value), at fp32 in fp32; bytes per token per direction = the closed form."""
    import math

    sender, receiver = run_distributed(_dtype_worker, 2)
    for (kind, dtype), sent in sender.items():
        e = {"fp32": 4, "bf16": 2}[dtype]
        expected = _CODECS[kind][1](e)
        fwd, bwd = expected if isinstance(expected, tuple) else (expected, expected)  # RVQ: its own widths
        got = {"fwd": sent["fwd"], "bwd": receiver[kind, dtype]["bwd"]}
        assert got == {"fwd": fwd, "bwd": bwd}, (kind, dtype, got, expected)
        assert math.isfinite(sent["loss"]), (kind, dtype)
    from nanotron_ext.mapl.closed_form import wire_per_token

    options = _CODECS["mapl_rvq"][0]
    for dtype, e in (("fp32", 4), ("bf16", 2)):  # `config show`'s form (mapl/closed_form.py) says the same
        cfg = small_config({**MODEL, "dtype": dtype, "codec": options}, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
        assert wire_per_token(cfg)[:2] == _CODECS["mapl_rvq"][1](e), dtype
