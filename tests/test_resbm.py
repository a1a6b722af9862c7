"""ResBM (arXiv:2604.11947) against an independent float64 implementation of its equations
(tests/reference_resbm.py): the rectangular identities, the forward at zero init, loss and every
gradient at PP=2 (both engines) and TP=2 x PP=2, replicated E/D gradients identical over TP, the bytes
on the wire, and the every-block-but-last placement on one process vs over PP=2."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_rows, micro_batches, one_step, small_config

MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16)
SEQ, MB, N_MICRO, SEED, H, M = 8, 2, 2, 1234, 8, 12


def test_trunc_pad_are_the_rectangular_identity() -> None:
    from nanotron_ext.resbm.codec import pad, trunc
    from tests.reference_resbm import rect_identity

    d, h = 16, 5
    x = torch.randn(3, 4, d, dtype=torch.float64)
    b = torch.randn(3, 4, h, dtype=torch.float64)
    assert torch.equal(trunc(pad(b, d), h), b)  # bit for bit
    assert torch.equal(trunc(x, h), x @ rect_identity(d, h))
    assert torch.equal(pad(b, d), b @ rect_identity(h, d))
    projection = torch.diag(torch.cat([torch.ones(h), torch.zeros(d - h)])).double()
    assert torch.equal(pad(trunc(x, h), d), x @ projection)
    # the paper's eq. 6 would make this the identity I_d; through a narrower width it is not
    assert not torch.allclose(pad(trunc(x, h), d), x)
    # eq. 6 does hold when the middle width is the widest: I_{h x d} I_{d x h} = I_h
    assert torch.equal(rect_identity(h, d) @ rect_identity(d, h), torch.eye(h, dtype=torch.float64))


def _config(pp: int, tp: int, engine: str, codec: dict):
    return small_config({**MODEL, "qk_norm": True, "codec": {"kind": "resbm", **codec}}, tp=tp, pp=pp, seq=SEQ, mb=MB,
                        n_micro=N_MICRO, parallelism={"pp_engine": engine})


def _worker(tp: int, pp: int, engine: str, codec: dict) -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.layout import codec_boundaries
    from tests.helpers.compare import worst_grad_error
    from tests.reference_resbm import resbm_loss, resbm_params

    ctx = build_parallel_context(dp=1, tp=tp, pp=pp, backend="gloo")
    cfg = _config(pp, tp, engine, codec)
    model = build_model(cfg, ctx)
    rows = fixed_rows(N_MICRO * MB, SEQ, MODEL["vocab_size"], SEED)
    loss, comm = one_step(model, micro_batches(rows, MB), ctx, engine)

    # the reference places bottlenecks where the whole model has them (all stages)
    stage_of_layer = model.stage_of_layer
    boundaries = codec_boundaries(cfg.model.codec.boundaries, stage_of_layer)
    ref = resbm_params(cfg.model, boundaries, H, M, cfg.general.seed)
    ref_loss = resbm_loss(cfg.model, ref, boundaries, H, rows[:, :-1], rows[:, 1:])
    ref_loss.backward()
    worst, worst_name, names = worst_grad_error(model, ref)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss, "ref_loss": ref_loss.item(), "worst": worst, "worst_name": worst_name,
            "names": names, "ref_names": sorted(ref), "comm": comm, "grads": grads,
            "pp_rank": dist.get_rank(ctx.pp_pg), "tp_rank": dist.get_rank(ctx.tp_pg)}


def _check(results: List[dict], pp: int) -> None:
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r["loss"]
        assert r["worst"] <= 1e-5, (r["worst_name"], r["worst"])
    assert set().union(*(r["names"] for r in results)) == set(results[0]["ref_names"])
    # one boundary per stage pair: h floats per token forward, their gradient backward, per micro-batch,
    # once over TP (each TP rank sends 1/tp of the replicated wire: parallelism.pp_scatter_gather)
    per_direction = N_MICRO * MB * SEQ * H * 4 // (len(results) // pp)
    for r in results:
        pp_comm = r["comm"].get("pp", {})
        assert pp_comm.get("send:fwd", {}).get("bytes", 0) == (per_direction if r["pp_rank"] < pp - 1 else 0)
        assert pp_comm.get("send:bwd", {}).get("bytes", 0) == (per_direction if r["pp_rank"] > 0 else 0)


CODEC = {"boundaries": "stages", "resbm": {"h": H, "m": M, "zero_init_encoder": False, "nonlinearity": "gelu"}}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["1f1b", "afab"])
def test_resbm_pp2_matches_float64_reference(engine: str) -> None:
    _check(run_distributed(_worker, 2, 1, 2, engine, CODEC), pp=2)


@pytest.mark.slow
def test_resbm_tp2_pp2_matches_reference_and_replicas_agree() -> None:
    codec = {**CODEC, "resbm": {**CODEC["resbm"], "norm": "both", "nonlinearity": "silu"}}
    results = run_distributed(_worker, 4, 2, 2, "1f1b", codec)
    _check(results, pp=2)
    # E and D are replicated over TP: every TP rank must hold the same gradient, bit for bit
    for stage in range(2):
        a, b = [r for r in results if r["pp_rank"] == stage]
        bottleneck = [n for n in a["grads"] if "boundary_" in n]
        assert bottleneck, "each stage holds an encoder or a decoder"
        for n in bottleneck:
            assert torch.equal(a["grads"][n], b["grads"][n]), n


@pytest.mark.slow
def test_every_block_but_last_one_process_equals_pp2_and_zero_init_forward() -> None:
    """The paper's convergence placement (after every block but the last): one process == PP=2, both
    == the float64 reference; with the last linears of E and D zero, the model's forward (loss)
    equals the reference's and the model is the plain truncated-identity path."""
    every = {"boundaries": "every_layer", "resbm": {"h": H, "m": M, "zero_init_encoder": False}}
    one = run_distributed(_worker, 1, 1, 1, "1f1b", every)
    two = run_distributed(_worker, 2, 1, 2, "afab", every)
    _check(one, pp=1)
    _check(two, pp=2)
    merged: Dict[str, torch.Tensor] = {}
    for r in two:
        merged.update(r["grads"])
    assert abs(one[0]["loss"] - two[0]["loss"]) <= 1e-6 * abs(one[0]["loss"])
    assert sorted(merged) == sorted(one[0]["grads"])
    for n, g in one[0]["grads"].items():
        torch.testing.assert_close(merged[n], g, rtol=1e-5, atol=1e-7, msg=n)
    zero = run_distributed(_worker, 1, 1, 1, "1f1b", {"boundaries": "every_layer", "resbm": {
        "h": H, "m": M, "zero_init_encoder": True, "zero_init_decoder": True}})[0]
    assert abs(zero["loss"] - zero["ref_loss"]) <= 1e-6 * zero["ref_loss"]
    assert zero["grads"]["decoder.0.pp_block.boundary_encoder.net.fc1.weight"].abs().max() == 0  # fc2 = 0 blocks it
    assert zero["grads"]["decoder.1.pp_block.boundary_decoder.net.fc1.weight"].abs().max() == 0
    assert zero["grads"]["decoder.1.pp_block.boundary_decoder.net.fc2.weight"].abs().max() > 0
