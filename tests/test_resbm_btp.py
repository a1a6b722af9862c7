"""ResBM ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism", arXiv:2604.11947) on a
residual stream sharded on d over TP (BOOST's btp): the sharded encoder/decoder against the paper's equations in
float64, and a composed btp model at tp = 2 against the same model at tp = 1."""
from __future__ import annotations

from typing import Dict

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_micro_batches, full_gradients, one_step, small_config
from tests.reference_resbm import ACT, rect_identity

D, H, M, EPS = 24, 14, 10, 1e-5  # h = 14 spans the first two shards at tp = 2 and 3 (shard 3 of 3 holds none of it)


def _full_params(norm: str, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {"enc.net.fc1.weight": torch.randn(M, D, generator=g) / D**0.5,
         "enc.net.fc2.weight": torch.randn(H, M, generator=g),
         "dec.net.fc1.weight": torch.randn(M, H, generator=g) / H**0.5,
         "dec.net.fc2.weight": torch.randn(D, M, generator=g)}
    if norm in ("encoder", "both"):
        p["enc.net.norm.weight"] = 1 + 0.3 * torch.randn(D, generator=g)
    if norm in ("decoder", "both"):
        p["dec.net.norm.weight"] = 1 + 0.3 * torch.randn(H, generator=g)
    return p


def _codec_worker(seed: int) -> list:
    """For each norm placement: encode this rank's shard, decode back to it; loss = sum over the shards of
    <W_res, pad_d(b)> + <W_hid, D(b)> (summed over TP by the backward all-reduces)."""
    import torch.distributed as torch_dist

    from nanotron_ext.codecs.base import feature_shard
    from nanotron_ext.models.init import load_full_state_dict_
    from nanotron_ext.resbm.codec import ShardedResBMDecoder, ShardedResBMEncoder
    from nanotron_ext.resbm.config import ResBMConfig

    torch_dist.init_process_group("gloo")
    pg = torch_dist.new_group(list(range(torch_dist.get_world_size())))
    mine = feature_shard(pg, D)
    out = []
    for norm in ("none", "both"):
        rc = ResBMConfig(h=H, m=M, norm=norm, nonlinearity="silu")
        enc = ShardedResBMEncoder(D, H, M, rc, EPS, torch.float32, pg)
        dec = ShardedResBMDecoder(D, H, M, rc, EPS, pg)
        full = _full_params(norm, seed)
        load_full_state_dict_(enc, {k[4:]: v for k, v in full.items() if k.startswith("enc.")})
        load_full_state_dict_(dec, {k[4:]: v for k, v in full.items() if k.startswith("dec.")})
        g = torch.Generator().manual_seed(seed + 1)
        residual, branch, w_res, w_hid = (torch.randn(2, 5, D, generator=g) for _ in range(4))
        res = residual[..., mine].clone().requires_grad_(True)
        br = branch[..., mine].clone().requires_grad_(True)
        wire = enc(residual=res, branch=br, input_ids=None)
        x, hid = dec(wire, None)
        ((w_res[..., mine] * x).sum() + (w_hid[..., mine] * hid).sum()).backward()
        grads = {f"enc.{n}": p.grad for n, p in enc.named_parameters()}
        grads.update({f"dec.{n}": p.grad for n, p in dec.named_parameters()})
        out.append({"norm": norm, "wire": wire.detach(), "x": x.detach(), "hid": hid.detach(), "d_res": res.grad,
                    "d_branch": br.grad, "grads": grads, "mine": (mine.start, mine.stop), "residual": residual,
                    "branch": branch, "w_res": w_res, "w_hid": w_hid})
    return out


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _reference(r: dict, seed: int) -> dict:
    """b = x I_{d x h} + W2 act(W1 n(f)); x' = b I_{h x d}, D(b) = W2' act(W1' n'(b)) (sec. 3.2-3.3), float64."""
    P = {k: v.double().requires_grad_(True) for k, v in _full_params(r["norm"], seed).items()}
    x = r["residual"].double().requires_grad_(True)
    f = r["branch"].double().requires_grad_(True)
    act = ACT["silu"]
    f_in = _rms_norm(f, P["enc.net.norm.weight"]) if "enc.net.norm.weight" in P else f
    b = x @ rect_identity(D, H) + act(f_in @ P["enc.net.fc1.weight"].T) @ P["enc.net.fc2.weight"].T
    b_in = _rms_norm(b, P["dec.net.norm.weight"]) if "dec.net.norm.weight" in P else b
    rebuilt = b @ rect_identity(H, D)
    hid = act(b_in @ P["dec.net.fc1.weight"].T) @ P["dec.net.fc2.weight"].T
    ((r["w_res"].double() * rebuilt).sum() + (r["w_hid"].double() * hid).sum()).backward()
    return {"wire": b.detach(), "x": rebuilt.detach(), "hid": hid.detach(), "d_res": x.grad, "d_branch": f.grad,
            "grads": {k: v.grad for k, v in P.items()}}


def _shard_of(name: str, grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """This rank's part of a full gradient: E's first linear and norm gain are split on d (the input), D's last
    linear on d (the output); the rest is replicated."""
    if name == "enc.net.fc1.weight":
        return grad[:, lo:hi]
    if name in ("enc.net.norm.weight", "dec.net.fc2.weight"):
        return grad[lo:hi]
    return grad


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_resbm_codec_equals_the_paper_equations_in_float64(tp: int) -> None:
    """One all-reduce of [trunc_h part, W1 part, sum of squares] in the encoder, one backward all-reduce of
    [db, da] in the decoder: wire, rebuilt shards and every input and parameter gradient equal the unsharded
    equations, with and without the encoder/decoder norms."""
    seed = 5
    results = run_distributed(_codec_worker, tp, seed)
    for case in range(2):
        ref = _reference(results[0][case], seed)
        for rank in results:
            r = rank[case]
            lo, hi = r["mine"]
            assert torch.equal(r["wire"], results[0][case]["wire"])  # the same on every TP rank: sent once
            close = dict(rtol=1e-5, atol=1e-5, msg=lambda m, r=r: f"norm={r['norm']}: {m}")
            torch.testing.assert_close(r["wire"].double(), ref["wire"], **close)
            torch.testing.assert_close(r["x"].double(), ref["x"][..., lo:hi], **close)
            torch.testing.assert_close(r["hid"].double(), ref["hid"][..., lo:hi], **close)
            torch.testing.assert_close(r["d_res"].double(), ref["d_res"][..., lo:hi], **close)
            torch.testing.assert_close(r["d_branch"].double(), ref["d_branch"][..., lo:hi], **close)
            assert r["grads"].keys() == ref["grads"].keys()
            for name, g in r["grads"].items():
                torch.testing.assert_close(g.double(), _shard_of(name, ref["grads"][name], lo, hi), **close)


# -- the composed model: btp + low rank + resbm at tp = 2 equals tp = 1 ------------------------------------------
MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
             tie_embeddings=False, tp_strategy="btp",
             codec={"kind": "resbm", "resbm": {"h": 12, "m": 10, "norm": "both", "zero_init_encoder": False}})
SEQ, MB, N_MICRO = 8, 2, 2


def _model_worker(kinds: tuple) -> dict:
    """Both layouts on the same 4 processes (one spawn): tp = 2 x pp = 2, then dp = 2 x tp = 1 x pp = 2 (two
    identical replicas; the test reads dp rank 0's). Per layout and low-rank kind, one 1F1B step: loss, every
    gradient as a full tensor (TP shards summed into place), the ledger."""
    return {tp: _model_step(tp, 2 // tp, kinds) for tp in (2, 1)}


def _model_step(tp: int, dp: int, kinds: tuple) -> dict:
    import torch.distributed as torch_dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=dp, tp=tp, pp=2, backend="gloo")
    out = {"dp_rank": torch_dist.get_rank(ctx.dp_pg)}
    for kind in kinds:
        cfg = small_config({**MODEL, "low_rank": {"kind": kind, "rank": 8}}, dp=dp, tp=tp, pp=2, seq=SEQ, mb=MB,
                           n_micro=N_MICRO)
        model = build_model(cfg, ctx)
        loss, comm = one_step(model, fixed_micro_batches(N_MICRO, MB, SEQ), ctx)
        out[kind] = {"loss": loss, "grads": full_gradients(model, ctx.tp_pg), "comm": comm}
    return out


def _pp_bytes(results: list, kind: str, op: str) -> int:
    return sum(r[kind]["comm"].get("pp", {}).get(op, {}).get("bytes", 0) for r in results)


@pytest.mark.slow
def test_btp_lowrank_resbm_at_tp2_equals_tp1() -> None:
    """svd and cola under btp with a ResBM boundary (both norms): at tp = 2 x pp = 2 the loss and every gradient
    (the codec's sharded E/D included) equal tp = 1 x pp = 2's, and the pipeline carries mbs * seq * h fp32 values
    per boundary, micro-batch and direction at both (the wire is sent once over TP, no token ids)."""
    kinds = ("svd", "cola")
    results = run_distributed(_model_worker, 4, kinds)
    one = [r[1] for r in results if r[1]["dp_rank"] == 0]
    two = [r[2] for r in results]
    boundary = N_MICRO * MB * SEQ * MODEL["codec"]["resbm"]["h"] * 4
    for kind in kinds:
        for op in ("send:fwd", "recv:fwd", "send:bwd", "recv:bwd"):
            assert _pp_bytes(one, kind, op) == boundary, (kind, op, one[0][kind]["comm"])
            assert _pp_bytes(two, kind, op) == boundary, (kind, op, two[0][kind]["comm"])
        ref = {n: g for r in one for n, g in r[kind]["grads"].items()}
        got = {n: g for r in two for n, g in r[kind]["grads"].items()}
        assert got.keys() == ref.keys() and any("boundary_decoder.net.fc2" in n for n in got)
        for name, g in got.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m,
                                       n=f"{kind} {name}": f"{n}: {m}")
        assert abs(two[-1][kind]["loss"] - one[-1][kind]["loss"]) <= 1e-5 * abs(one[-1][kind]["loss"])


def test_analyse_refuses_a_weight_btp_shards(tmp_path) -> None:
    """Under btp at tp > 1 E's first and D's last linear are split on d: one file holds rank 0's part only."""
    import json

    from nanotron_ext.resbm.analyse import load_weights

    meta = {"layout": {"dp": 1, "tp": 2, "pp": 1}, "config": {"model": {"tp_strategy": "btp"}}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    torch.save({"model": {"decoder.0.pp_block.boundary_encoder.net.fc1.weight": torch.ones(4, 8),
                          "decoder.0.pp_block.boundary_encoder.net.fc2.weight": torch.ones(3, 4)}},
               tmp_path / "pp0_dp0_tp0.pt")
    assert list(load_weights(tmp_path, r"boundary_encoder\.net\.fc2\.weight")) == [
        "decoder.0.pp_block.boundary_encoder.net.fc2.weight"]  # replicated under btp too
    with pytest.raises(ValueError, match="btp shards decoder.0.pp_block.boundary_encoder.net.fc1.weight"):
        load_weights(tmp_path, r"boundary_encoder\.net\.fc\d\.weight")
    with pytest.raises(ValueError, match="only TP-replicated weights"):
        load_weights(tmp_path, r"fc2\.weight$")
