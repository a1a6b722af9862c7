"""Subspace Models on BOOST's btp-sharded residual stream (each TP rank holds d/tp features): a tiny low-rank
Llama with model.codec.kind=subspace at tp = 2, pp = 2 against the same composed model at tp = 1, pp = 2 (where
the shard is the whole stream): loss and every gradient agree, pipeline bytes per boundary are the same, and
after a few optimiser steps every constrained output weight, assembled from its TP shards here, lies in
span(U) and the boundary rebuilds exactly what the sending stage computed (checked against U directly, not
through the codec)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_micro_batches, one_step, small_config

MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
             tie_embeddings=False)
SEQ, MB, N_MICRO, K, STEPS = 8, 2, 2, 8, 2


def _micro(seed: int) -> List[Dict[str, torch.Tensor]]:
    return fixed_micro_batches(N_MICRO, MB, SEQ, seed=seed)


def _shards(p: torch.Tensor) -> Optional[tuple]:
    """(unsharded shape, [(local slices, global slices)]) of a TP-sharded parameter; None when replicated."""
    from nanotron.parallel.parameters import NanotronParameter

    if not (isinstance(p, NanotronParameter) and p.is_sharded):
        return None
    info = p.get_sharded_info()
    return tuple(info.unsharded_shape), [(x.local_slices, x.global_slices) for x in info.local_global_slices_pairs]


def _btp_worker(tp: int, cases: Dict[str, Tuple[dict, dict]]) -> Dict[str, dict]:
    """Per case (low_rank, subspace), on one set of process groups: one step's loss and gradients, the pipeline
    bytes; then STEPS optimiser steps and, on a last forward, the constrained weights (this rank's rows) and what
    crosses the boundary on both sides."""
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=tp, pp=2, backend="gloo")
    return {name: _run_case(ctx, tp, *case) for name, case in cases.items()}


def _run_case(ctx, tp: int, low_rank: dict, subspace: dict) -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.codecs.base import feature_shard
    from nanotron_ext.models.build import build_model
    from nanotron_ext.models.dense import dense_state_dict
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.subspace.constraints import row_group
    from nanotron_ext.subspace.pieces import hub_of
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    cfg = small_config({**MODEL, "tp_strategy": "btp", "low_rank": low_rank, "codec": {"kind": "subspace"},
                        "subspace": {"k": K, **subspace}}, tp=tp, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO,
                       optimizer={"lr": 1e-2})
    model = build_model(cfg, ctx)
    hub, engine = hub_of(model), make_engine("1f1b")
    pp_rank, d = dist.get_rank(ctx.pp_pg), MODEL["hidden_size"]
    loss, comm = one_step(model, _micro(0), ctx, engine)
    out = {"loss": loss, "pp_rank": pp_rank, "tp_rank": dist.get_rank(ctx.tp_pg),
           "comm": comm.get("pp", {}), "u": hub.basis.clone(),
           "grads": {n: (p.grad.detach().clone(), _shards(p)) for n, p in model.named_parameters()
                     if p.grad is not None}}
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    losses = []
    for step in range(STEPS):
        opt.step()
        opt.zero_grad()
        model.after_optimizer_step()
        losses.append(forward_backward(model, engine, _micro(step + 1), ctx).item())
    out["losses"] = losses
    # the standard layout's weights (export): W = U C multiplied out from the TP shards of a btp up factor
    out["dense"] = dense_state_dict(model, ctx.tp_pg, exact=low_rank["kind"] == "svd")
    names = {id(m): n for n, m in model.named_modules()}
    rows = {names[id(lin)]: (lin.weight.detach().clone(), feature_shard(row_group(lin), d)) for lin in hub.constrained}
    out["constrained"] = {n: (w, (s.start, s.stop)) for n, (w, s) in rows.items()}
    crossing: List[torch.Tensor] = []
    boundary = model.stage_of_layer.index(1) - 1  # the last layer of stage 0
    if pp_rank == 0:
        def on_encode(module, args, kwargs, _out) -> None:
            crossing.append((kwargs["residual"] + kwargs["branch"]).detach().clone())

        model.decoder[boundary].pp_block.boundary_encoder.register_forward_hook(on_encode, with_kwargs=True)
    else:
        def on_decode(module, args, outputs) -> None:
            crossing.append(outputs[0].detach().clone())

        model.decoder[boundary + 1].pp_block.boundary_decoder.register_forward_hook(on_decode)
    forward_backward(model, engine, _micro(STEPS + 1), ctx)
    out["crossing"] = crossing
    return out


def _assemble(per_rank: List[Tuple[torch.Tensor, Optional[tuple]]]) -> torch.Tensor:
    """The full tensor from each TP rank's (local tensor, shard info); a replicated one must agree everywhere."""
    local, info = per_rank[0]
    if info is None:
        for other, _ in per_rank[1:]:
            assert torch.equal(other, local)
        return local
    full = torch.full(info[0], float("nan"), dtype=local.dtype)
    for tensor, (_, pairs) in per_rank:
        for loc, glob in pairs:
            full[glob] = tensor[loc]
    assert not full.isnan().any()
    return full


def _by_stage(results: List[dict]) -> Dict[int, List[dict]]:
    out: Dict[int, List[dict]] = {}
    for r in sorted(results, key=lambda r: r["tp_rank"]):
        out.setdefault(r["pp_rank"], []).append(r)
    return out


CASES = {  # svd + reparam with a full-rank attention output (row-parallel, all d rows: W = U C with C split on
    # d_in) beside factorised MLP down projections (btp's up factor, rows S_r: W_S = U_S C, C replicated); cola +
    # projection with every linear factorised (the up factors re-projected with one all-reduce of U^T W)
    "svd_reparam": ({"kind": "svd", "targets": ["q", "k", "v", "gate", "up", "down"]},
                    {"parameterisation": "reparam"}),
    "cola_projection": ({"kind": "cola"}, {"parameterisation": "projection"}),
}


@pytest.fixture(scope="module")
def runs() -> Dict[int, List[Dict[str, dict]]]:
    """Every case at tp = 1 and tp = 2 (pp = 2), one set of processes per tp."""
    return {tp: run_distributed(_btp_worker, 2 * tp, tp, CASES) for tp in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_btp_subspace_tp2_equals_tp1_and_stays_in_span(runs: Dict[int, List[Dict[str, dict]]], case: str) -> None:
    one, two = ([r[case] for r in runs[tp]] for tp in (1, 2))
    ref, got = _by_stage(one), _by_stage(two)
    u = one[0]["u"].double()
    for stage in (0, 1):
        (r1,), ranks = ref[stage], got[stage]
        for r in ranks:
            assert abs(r["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
            for a, b in zip(r["losses"], r1["losses"]):
                assert abs(a - b) <= 1e-4 * abs(b), (r["losses"], r1["losses"])
        assert ranks[0]["grads"].keys() == r1["grads"].keys()
        for name, (g1, _) in r1["grads"].items():
            g2 = _assemble([r["grads"][name] for r in ranks])
            torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-5 * float(g1.abs().max()), msg=name)
        for r in ranks:
            assert r["dense"].keys() == r1["dense"].keys()
            for name, w in r1["dense"].items():
                torch.testing.assert_close(r["dense"][name], w, rtol=1e-3, atol=1e-4 * float(w.abs().max()), msg=name)
        for name in r1["constrained"]:  # assembled from the TP row shards, then checked against U itself
            w1 = r1["constrained"][name][0].double()
            parts = [r["constrained"][name] for r in ranks]
            # btp's up factor: rows (d) split over TP; a row-parallel full-rank weight: its input columns
            w2 = torch.cat([w for w, _ in parts], dim=0 if parts[0][1][0] is not None else 1).double()
            for w in (w1, w2):
                assert float((w - u @ (u.T @ w)).norm() / w.norm()) <= 1e-5, name
            torch.testing.assert_close(w2, w1, rtol=1e-3, atol=1e-4 * float(w1.abs().max()), msg=name)
    grads, constrained = {n for r in two for n in r["grads"]}, {n for r in two for n in r["constrained"]}
    if case == "svd_reparam":
        assert any(n.endswith("o_proj.weight_small") for n in grads)
        assert any(n.endswith("down_proj.up.weight_small") for n in grads)
    else:
        assert any(n.endswith("o_proj.up") for n in constrained) and any(n.endswith("down_proj.up")
                                                                         for n in constrained)
    for results in (one, two):  # the boundary rebuilds exactly what the sending stage computed, shard by shard
        stages = _by_stage(results)
        for sent, received in zip(stages[0], stages[1]):
            assert len(sent["crossing"]) == len(received["crossing"]) == N_MICRO
            for x, y in zip(sent["crossing"], received["crossing"]):
                assert float((x - y).norm() / x.norm()) <= 1e-5
    for op in ("send:fwd", "recv:fwd", "send:bwd", "recv:bwd"):  # the wire is sent once over TP
        per_step = N_MICRO * MB * SEQ * (K * 4 + 4)  # fp32 Z plus the packed ids
        assert sum(r["comm"].get(op, {}).get("bytes", 0) for r in one) == per_step, (op, one[0]["comm"])
        assert sum(r["comm"].get(op, {}).get("bytes", 0) for r in two) == per_step, (op, two[0]["comm"])


@pytest.mark.parametrize("sets", [["model.subspace.grassmann_every=2"],
                                  ["model.subspace.parameterisation=projection", "model.subspace.modified_adamw=true"]],
                         ids=["grassmann", "modified_adamw"])
def test_options_that_need_all_d_features_are_refused_at_load_under_btp(sets: List[str]) -> None:
    """Grassmann updates (G^T G of the whole residual gradient) and the modified AdamW (a mean over all d rows)
    cannot run on a sharded stream: one line naming both keys at tp = 2; tp = 1 (the shard is the stream) loads."""
    from nanotron_ext.config import ConfigError, load_config
    from tests.test_three_tiers import HET, overrides

    with pytest.raises(ConfigError) as e:
        load_config(HET, overrides("btp", "subspace", "allreduce") + sets)
    key = sets[-1].split("=")[0]
    assert "\n" not in str(e.value) and str(e.value).startswith(key), str(e.value)
    assert "model.tp_strategy='btp' at parallelism.tp=2" in str(e.value)
    load_config(HET, overrides("btp", "subspace", "allreduce", tp=1) + sets)
