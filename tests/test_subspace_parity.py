"""Subspace Models end to end on gloo processes: with the constraints holding, the compressed pipeline's
loss and gradients equal an independent float64 reference of the same weights (tests/subspace_reference.py
on tests/reference_llama.py), the sender receives G U U^T, the ledger counts the closed-form bytes, the
constraints hold over 200 optimiser steps (and plain AdamW without projection drifts), and a Grassmann
update keeps the model exact."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_rows, micro_batches, one_step, small_config

MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16)
SEQ, MB, N_MICRO, SEED, K = 8, 2, 2, 1234, 8


def _cfg(tp: int, pp: int, engine: str, subspace: dict, boundaries="stages", codec: str = "subspace"):
    model = {**MODEL, "codec": {"kind": codec, "boundaries": boundaries}, "embedding": {"kind": "subspace"},
             "output_constraint": {"kind": "subspace"}, "subspace": {"k": K, **subspace}}
    return small_config(model, tp=tp, pp=pp, seq=SEQ, mb=MB, n_micro=N_MICRO, parallelism={"pp_engine": engine})


def _rows(seed: int) -> torch.Tensor:
    return fixed_rows(N_MICRO * MB, SEQ, MODEL["vocab_size"], seed)


def _micro(rows: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
    return micro_batches(rows, MB, N_MICRO)


def _parity_worker(tp: int, pp: int, engine: str, subspace: dict) -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.subspace.pieces import hub_of
    from tests.helpers.compare import worst_grad_error
    from tests.subspace_reference import subspace_reference

    ctx = build_parallel_context(dp=1, tp=tp, pp=pp, backend="gloo")
    cfg = _cfg(tp, pp, engine, subspace)
    model = build_model(cfg, ctx)
    hub = hub_of(model)
    pp_rank = dist.get_rank(ctx.pp_pg)
    last_of_stage0 = model.stage_of_layer.index(1) - 1
    sender: List[torch.Tensor] = []
    received: List[torch.Tensor] = []
    if pp_rank == 0:  # the gradient reaching the encoder's input x = residual + branch
        enc = model.decoder[last_of_stage0].pp_block.boundary_encoder

        def on_encode(module, args, kwargs, out) -> None:
            kwargs["branch"].register_hook(lambda g: sender.append(g.clone()))

        enc.register_forward_hook(on_encode, with_kwargs=True)
    if pp_rank == 1:  # the full gradient of the rebuilt X on the receiving side
        dec = model.decoder[last_of_stage0 + 1].pp_block.boundary_decoder

        def on_decode(module, args, out) -> None:
            out[0].register_hook(lambda g: received.append(g.clone()))

        dec.register_forward_hook(on_decode)
    rows = _rows(SEED)
    loss, comm = one_step(model, _micro(rows), ctx, engine)
    ref = subspace_reference(cfg.model, cfg.general.seed, hub.basis, hub.fixed, rows)
    out = {"loss": loss, "ref_loss": ref["__loss__"].item(), "comm": comm.get("pp", {}), "pp_rank": pp_rank,
           "sender": sender, "received": received, "u": hub.basis.clone()}
    if subspace.get("parameterisation") == "projection":  # compare P grad for the full constrained weights
        errs = {}
        for name, p in model.named_parameters():
            g, r = p.grad.double(), ref[name].grad
            if name.endswith(("o_proj.weight", "down_proj.weight")) and ".3." not in name:
                errs[name] = {"raw": ((g - r).norm() / r.norm()).item(),
                              "projected": ((hub.project(g) - hub.project(r)).norm() / hub.project(r).norm()).item()}
            else:
                errs[name] = {"raw": ((g - r).norm() / r.norm()).item()}
        out["errs"] = errs
    else:
        out["worst"], out["worst_name"], out["names"] = worst_grad_error(model, ref)
    return out


def _check_bytes(results: List[dict], pp: int) -> None:
    # forward: Z (k fp32) + one int32 id per token; backward: the packed wire's gradient, same width
    per_micro = MB * SEQ * (K * 4 + 4) // (len(results) // pp)  # once over TP: 1/tp per TP rank
    for r in results:
        fwd = r["comm"].get("send:fwd", {}).get("bytes", 0)
        bwd = r["comm"].get("send:bwd", {}).get("bytes", 0)
        assert fwd == (N_MICRO * per_micro if r["pp_rank"] < pp - 1 else 0), r["comm"]
        assert bwd == (N_MICRO * per_micro if r["pp_rank"] > 0 else 0), r["comm"]


def _check_sender_gradient(results: List[dict]) -> None:
    sender = next(r for r in results if r["pp_rank"] == 0)
    receiver = next(r for r in results if r["pp_rank"] == 1)
    u = sender["u"]
    assert len(sender["sender"]) == len(receiver["received"]) == N_MICRO
    for got, g in zip(sender["sender"], receiver["received"]):
        expected = g @ u @ u.T
        assert (g - expected).norm() / g.norm() > 0.1, "G must have a part outside span(U) for the check to bite"
        assert (got - expected).norm() / expected.norm() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,engine", [(1, 2, "1f1b"), (1, 2, "afab"), (2, 2, "1f1b")])
def test_reparam_pipeline_equals_float64_reference(tp: int, pp: int, engine: str) -> None:
    results = run_distributed(_parity_worker, tp * pp, tp, pp, engine, {"parameterisation": "reparam"})
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) / r["ref_loss"] <= 1e-5
        assert r["worst"] <= 1e-5, (r["worst_name"], r["worst"])
    assert any("o_proj.weight_small" in n for r in results for n in r["names"])
    _check_bytes(results, pp)
    _check_sender_gradient(results)


@pytest.mark.slow
def test_projection_pipeline_equals_reference_up_to_the_out_of_span_gradient() -> None:
    """Full weights in span(U): loss and every unconstrained gradient are exact; a constrained weight's
    gradient upstream of the boundary differs by (I - U U^T) G h^T (the projected-away part of the
    activation gradient), so its projection onto span(U) is what matches."""
    results = run_distributed(_parity_worker, 2, 1, 2, "1f1b", {"parameterisation": "projection"})
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) / r["ref_loss"] <= 1e-5
        for name, e in r["errs"].items():
            assert e.get("projected", e["raw"]) <= 1e-5, (name, e)
    stage0 = next(r for r in results if r["pp_rank"] == 0)["errs"]
    assert max(e["raw"] for n, e in stage0.items() if "projected" in e) > 1e-2  # the raw ones do differ
    _check_bytes(results, 2)
    _check_sender_gradient(results)


def _off_span(hub, lins) -> List[float]:
    return [float((w - hub.project(w)).norm() / w.norm()) for w in (lin.weight.detach() for lin in lins)]


def _drift_worker(variants: Dict[str, tuple], steps: int) -> Dict[str, dict]:
    """One process; `steps` optimiser steps per variant; worst off-span ratio per projection kind."""
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.subspace.pieces import hub_of
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo")
    out = {}
    for name, (subspace, boundaries) in variants.items():
        cfg = _cfg(1, 1, "1f1b", subspace, boundaries)
        cfg.optimizer.lr = 1e-2
        model = build_model(cfg, ctx)
        hub = hub_of(model)
        opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
        engine = make_engine("1f1b")
        for step in range(steps):
            forward_backward(model, engine, _micro(_rows(step)), ctx)
            opt.step()
            opt.zero_grad()
            model.after_optimizer_step()
        attn = [lin for lin in hub.constrained if lin.in_features == MODEL["hidden_size"]]
        down = [lin for lin in hub.constrained if lin.in_features == MODEL["ffn_size"]]
        out[name] = {"attn_out": max(_off_span(hub, attn)), "mlp_down": max(_off_span(hub, down)),
                     "layers": len(hub.constrained) // 2}
    return out


DRIFT_VARIANTS = {
    "projection_reprojected": ({"parameterisation": "projection"}, "every_layer"),
    "reparam": ({"parameterisation": "reparam"}, "every_layer"),
    "adamw_not_reprojected": ({"parameterisation": "projection", "reproject": False}, "every_layer"),
    "modified_adamw_not_reprojected": ({"parameterisation": "projection", "reproject": False, "modified_adamw": True},
                                       "every_layer"),
}


@pytest.mark.slow
def test_constraints_hold_over_200_steps_and_plain_adamw_drifts() -> None:
    r = run_distributed(_drift_worker, 1, DRIFT_VARIANTS, 200, timeout_s=600)[0]
    print(r)
    assert r["reparam"]["layers"] == MODEL["num_layers"] - 1  # the last block stays uncompressed
    for kept in ("projection_reprojected", "reparam"):
        assert max(r[kept]["attn_out"], r[kept]["mlp_down"]) <= 1e-6, (kept, r[kept])
    assert min(r["adamw_not_reprojected"]["attn_out"], r["adamw_not_reprojected"]["mlp_down"]) > 1e-3, r
    # sec. 5's AdamW keeps a weight whose gradient is in span(U): the down projection right before a
    # boundary; the attention output feeds the MLP inside the block, its gradient is not in span(U)
    modified = r["modified_adamw_not_reprojected"]
    assert modified["mlp_down"] <= 1e-5 and modified["attn_out"] > 1e-3, modified


def _grassmann_worker(parameterisation: str) -> dict:
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.subspace.grassmann import grassmann_objective
    from nanotron_ext.subspace.pieces import hub_of
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine
    from tests.helpers.compare import worst_grad_error
    from tests.subspace_reference import subspace_reference

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo")
    cfg = _cfg(1, 1, "1f1b", {"parameterisation": parameterisation, "grassmann_every": 2, "grassmann_lr": 0.3},
               "every_layer")
    model = build_model(cfg, ctx)
    hub = hub_of(model)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    engine = make_engine("1f1b")
    u0 = hub.basis.clone()
    last = max(hub.decoders, key=lambda dec: dec.boundary)
    for step in range(2):
        forward_backward(model, engine, _micro(_rows(step)), ctx)
        opt.step()
        opt.zero_grad()
        if step == 1:
            a = last.grad_gram.double().clone()
            # as the constraint leaves them on the old span (projection re-projects first)
            before = [u0 @ (u0.T @ lin.weight.detach()) for lin in hub.constrained]
            table = model.token_embedding.pp_block.embedding.small.weight
            low_before = table.detach() @ hub.basis.T  # T_S U^T, the trained part of the embedding
            assert hub.basis.equal(u0), "no update before grassmann_every steps"
        model.after_optimizer_step()
    u1 = hub.basis.clone()
    p1 = u1 @ u1.T
    # the model follows the basis: each in-span weight becomes its projection onto the new span
    follow = max([float((lin.weight.detach() - p1 @ w).norm() / w.norm()) for lin, w in zip(hub.constrained, before)]
                 + [float((table.detach() @ u1.T - low_before @ p1).norm() / low_before.norm())])
    reset = float(last.grad_gram.abs().max())
    rows = _rows(99)
    loss = forward_backward(model, engine, _micro(rows), ctx)
    params = dict(model.named_parameters())
    ref = subspace_reference(cfg.model, cfg.general.seed, u1, hub.fixed, rows, current=lambda n: params[n])
    out = {
        "orth": float((u1.T @ u1 - torch.eye(K)).abs().max()), "moved": float((u1 - u0).norm()), "follow": follow,
        "f_before": float(grassmann_objective(a, u0.double())), "f_after": float(grassmann_objective(a, u1.double())),
        "reset": reset,
        "loss": loss.item(), "ref_loss": ref["__loss__"].item(), "off_span": max(_off_span(hub, hub.constrained)),
        "saved_u": model.state_dict()["decoder.0.pp_block.attn.o_proj.hub.basis"].equal(u1)
        if parameterisation == "reparam" else True,
    }
    if parameterisation == "reparam":
        out["worst"], out["worst_name"], _ = worst_grad_error(model, ref)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parameterisation", ["reparam", "projection"])
def test_grassmann_update_keeps_u_orthonormal_decreases_f_and_the_model_exact(parameterisation: str) -> None:
    r = run_distributed(_grassmann_worker, 1, parameterisation)[0]
    assert r["orth"] <= 1e-6 and r["moved"] > 1e-3, r
    assert r["f_after"] < r["f_before"], r
    assert r["off_span"] <= 1e-6 and r["follow"] <= 1e-5, r  # weights follow U onto the new span
    assert r["reset"] == 0.0, r
    assert abs(r["loss"] - r["ref_loss"]) / r["ref_loss"] <= 1e-5, r
    assert r["saved_u"], "U is a checkpointed buffer"
    if parameterisation == "reparam":
        assert r["worst"] <= 1e-5, r


def _state_worker() -> dict:
    """Bytes of unique parameters and buffers of the uncompressed and the SM model (projection: same
    output projections), single process, codec after every block but the last."""
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo")
    out = {}
    for name, cfg in (("plain", _cfg(1, 1, "1f1b", {}, "every_layer", codec="identity")),
                      ("sm", _cfg(1, 1, "1f1b", {"parameterisation": "projection"}, "every_layer"))):
        if name == "plain":
            cfg.model.embedding.kind, cfg.model.output_constraint.kind = "standard", "none"
        model = build_model(cfg, ctx)
        unique = lambda ts: {id(t): t for t in ts}.values()  # noqa: E731 - the hub is shared by many modules
        out[name] = {kind: sum(t.numel() * t.element_size() for t in unique(ts))
                     for kind, ts in (("params", model.parameters()), ("buffers", model.buffers()))}
    return out


def test_sm_memory_overhead_is_t_fixed_and_u_and_the_smaller_token_table() -> None:
    """Table 3 (appendix 8.8) at its root: the state SM adds is the fixed table T_fixed (V x d) and U (d x k),
    in buffers (and the hub's 8-byte step counter), nothing else; the trained token table shrinks from V x d to V x k
    (closed forms, fp32)."""
    r = run_distributed(_state_worker, 1)[0]
    v, d = MODEL["vocab_size"], MODEL["hidden_size"]
    assert r["sm"]["buffers"] - r["plain"]["buffers"] == 4 * (v * d + d * K) + 8  # + the int64 step counter
    assert r["plain"]["params"] - r["sm"]["params"] == 4 * v * (d - K)


def _tied_worker(tp: int) -> dict:
    """pp = 1 (as every tied model), the subspace codec after every block but the last on one stage, the
    head tied to the split table: loss and gradients against the float64 reference (which builds the
    tied head from TE = T_fixed + T_S U^T by definition)."""
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.subspace.pieces import hub_of
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine
    from tests.helpers.compare import worst_grad_error
    from tests.subspace_reference import subspace_reference

    ctx = build_parallel_context(dp=1, tp=tp, pp=1, backend="gloo")
    cfg = _cfg(tp, 1, "1f1b", {"parameterisation": "reparam"}, "every_layer")
    cfg.model.tie_embeddings = True
    model = build_model(cfg, ctx)
    hub = hub_of(model)
    rows = _rows(SEED)
    loss = forward_backward(model, make_engine("1f1b"), _micro(rows), ctx)
    ref = subspace_reference(cfg.model, cfg.general.seed, hub.basis, hub.fixed, rows)
    worst, worst_name, names = worst_grad_error(model, ref)
    return {"loss": loss.item(), "ref_loss": ref["__loss__"].item(), "worst": worst, "worst_name": worst_name,
            "names": names}


@pytest.mark.parametrize("tp", [1, 2])
def test_tied_head_reads_the_split_table_and_equals_float64_reference(tp: int) -> None:
    """model.tie_embeddings with the split embedding: logits = h (T_fixed + T_S U^T)^T over each TP rank's
    vocabulary shard; the loss and every gradient (T_S receives both the embedding's and the head's) equal
    the reference; the head holds no weight of its own."""
    for r in run_distributed(_tied_worker, tp, tp):
        assert abs(r["loss"] - r["ref_loss"]) / r["ref_loss"] <= 1e-5
        assert r["worst"] <= 1e-5, (r["worst_name"], r["worst"])
        assert "lm_head.pp_block.lm_head.weight" not in r["names"]
        assert "token_embedding.pp_block.embedding.small.weight" in r["names"]
