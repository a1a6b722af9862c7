"""MAPL on a BTP-sharded residual stream (each TP rank holds d/tp features), against independent references:

- codec level, tp = 2 and 3: the sharded encoder + decoder (Z = sum over feature shards of (X - anchor)_S A_S, one
  all-reduce of the r-wide Z; the decoder column-parallel, its backward summing dZ over TP), with the copies'
  gradients combined as after a training step, give the wire, the rebuilt shard and the gradients of both inputs
  and of A_p and E_small_p of a float64 computation written here from the paper's equations;
- model level: a tiny low-rank Llama under model.tp_strategy: btp with model.codec.kind: mapl (plain, and with RVQ)
  at tp = 2 x pp = 2 gives the loss and every gradient of the same model at tp = 1 x pp = 2, with the same bytes
  over the pipeline link per boundary (the wire and the copies' gradient exchange cross it once, not tp times).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_rows, micro_batches, one_step, small_config

D, V, R, M = 24, 40, 6, 4  # codec level: d divides over tp = 2 and 3


def _sharded_codec_worker(seed: int, sync: str) -> dict:
    """Encode this rank's feature shard, decode back to it; loss = sum(W * X') over the shards (summed over TP);
    then the copies' gradients are combined as the trainer does after the backward (sync_boundaries)."""
    from types import SimpleNamespace

    import torch.distributed as torch_dist

    from nanotron_ext.codecs.base import feature_shard
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import ModelConfig
    from nanotron_ext.mapl.codec import MaplDecoder, MaplEncoder
    from nanotron_ext.mapl.sync import sync_boundaries

    torch_dist.init_process_group("gloo")
    pg = torch_dist.new_group(list(range(torch_dist.get_world_size())))
    cfg = from_dict(ModelConfig, {"vocab_size": V, "hidden_size": D, "ffn_size": 32, "num_heads": 2, "num_kv_heads": 2,
                                  "num_layers": 2, "tie_embeddings": False,
                                  "codec": {"kind": "mapl",
                                            "mapl": {"rank": R, "anchor_width": M, "shared_sync": sync}}})
    enc, dec = MaplEncoder(cfg, 0, pg), MaplDecoder(cfg, 0, pg)
    g = torch.Generator().manual_seed(seed)
    table = 0.5 * torch.randn(V, M, generator=g)
    for side in (enc, dec):
        side.init_own_parameters_(seed)
        with torch.no_grad():
            side.projection.anchor_table.copy_(table)
    ids = torch.randint(0, V, (2, 5), generator=g)
    residual, branch, weight = (torch.randn(2, 5, D, generator=g) for _ in range(3))
    mine = feature_shard(pg, D)
    res = residual[..., mine].clone().requires_grad_(True)
    br = branch[..., mine].clone().requires_grad_(True)
    wire = enc(residual=res, branch=br, input_ids=ids)
    x, _ = dec(wire, ids)
    (weight[..., mine] * x).sum().backward()
    sync_boundaries({0: enc}, {0: dec}, SimpleNamespace(pg=pg))  # both sides on this rank: nothing crosses PP
    p = enc.projection
    return {"wire": wire.detach(), "x": x.detach(), "d_res": res.grad, "d_branch": br.grad,
            "mine": (mine.start, mine.stop),
            "A": p.A.detach(), "P": p.anchor_basis, "table": table, "ids": ids, "residual": residual, "branch": branch,
            "weight": weight, "grads": {f"{n}.{k}": getattr(s.projection, k).grad for n,
                                        s in (("enc", enc), ("dec", dec))
                                        for k in ("A", "anchor_table")}}


@pytest.mark.slow
@pytest.mark.parametrize("tp,sync", [(2, "rows"), (3, "dense")])
def test_sharded_mapl_codec_equals_the_paper_equations_in_float64(tp: int, sync: str) -> None:
    """anchor = E_small[ids] P, Z = (X - anchor) A, X' = Z A^T + anchor with ONE copy of A and E_small (the two
    copies' gradients are the whole gradient once combined): float64 autograd here, every TP rank compared."""
    results = run_distributed(_sharded_codec_worker, tp, 5, sync)
    r0 = results[0]
    a = r0["A"].double().requires_grad_(True)
    table = r0["table"].double().requires_grad_(True)
    residual = r0["residual"].double().requires_grad_(True)
    branch = r0["branch"].double().requires_grad_(True)
    anchor = table[r0["ids"]] @ r0["P"].double()
    z = (residual + branch - anchor) @ a
    x = z @ a.T + anchor
    (r0["weight"].double() * x).sum().backward()
    close = dict(rtol=1e-5, atol=1e-5)
    for r in results:
        lo, hi = r["mine"]
        assert hi - lo == D // tp
        assert torch.equal(r["wire"], r0["wire"])  # replicated over TP: the pipeline may send it once
        torch.testing.assert_close(r["wire"].double(), z.detach(), **close)
        torch.testing.assert_close(r["x"].double(), x.detach()[..., lo:hi], **close)
        torch.testing.assert_close(r["d_res"].double(), residual.grad[..., lo:hi], **close)
        torch.testing.assert_close(r["d_branch"].double(), branch.grad[..., lo:hi], **close)
        for side in ("enc", "dec"):  # both copies, on every TP rank, hold the whole gradient
            torch.testing.assert_close(r["grads"][f"{side}.A"].double(), a.grad, **close)
            torch.testing.assert_close(r["grads"][f"{side}.anchor_table"].double(), table.grad, **close)
            assert torch.equal(r["grads"][f"{side}.A"], r0["grads"][f"{side}.A"])  # bit-identical over TP


# -- model level: btp + mapl at tp = 2 x pp = 2 against tp = 1 x pp = 2 -----------------------------------------
MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16,
             tie_embeddings=False)
SEQ, MB, N_MICRO, MR, MM = 8, 2, 2, 8, 4
PLAIN = {"kind": "mapl", "boundaries": "stages", "mapl": {"rank": MR, "anchor_width": MM}}
RVQ = {"kind": "mapl", "boundaries": "stages", "mapl": {"rank": MR, "anchor_width": MM, "vq_groups": 2, "vq_rounds": 2,
                                                         "vq_codebook": 16, "grad_bits": 8}}


def _batch() -> torch.Tensor:
    return fixed_rows(N_MICRO * MB, SEQ)


CASES = {"svd-mapl": ("svd", PLAIN), "cola-mapl_rvq": ("cola", RVQ)}


def _btp_worker(tp: int, references: dict) -> dict:
    """One 1F1B step of each case at tp x pp = 2 (one process group, models built in turn): loss, the ledger, this
    rank's gradients (tp = 1) or their worst relative error against `references[case]` (the tp = 1 gradients by
    name, sliced to this rank's shard)."""
    import nanotron.distributed as dist

    from nanotron_ext.mapl.codec import BoundaryProjection
    from nanotron_ext.models.build import build_model
    from nanotron_ext.models.init import local_shard
    from nanotron_ext.optim import clip_grad_norm_
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=tp, pp=2, backend="gloo")
    micro = micro_batches(_batch(), MB)
    results = {}
    for case, (low_rank, codec) in CASES.items():
        cfg = small_config({**MODEL, "low_rank": {"kind": low_rank}, "tp_strategy": "btp", "codec": codec}, tp=tp,
                           pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
        model = build_model(cfg, ctx)
        with torch.no_grad():  # a non-zero anchor table, the same at every tp
            for m in model.modules():
                if isinstance(m, BoundaryProjection):
                    m.anchor_table.copy_(0.1 * torch.randn(m.anchor_table.shape,
                                                           generator=torch.Generator().manual_seed(3)))
        loss, comm = one_step(model, micro, ctx)
        out = {"loss": loss, "comm": comm, "pp_rank": dist.get_rank(ctx.pp_pg), "names": [],
               "codebooks": {n: b.clone() for n, b in model.named_buffers() if ".quantizer." in n}}
        if not references:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        else:
            out["worst"], out["worst_name"] = 0.0, None
            for name, p in model.named_parameters():
                expected = local_shard(references[case][name], p).double()
                rel = ((p.grad.double() - expected).norm() / expected.norm()).item()
                out["names"].append(name)
                if rel >= out["worst"]:
                    out["worst"], out["worst_name"] = rel, name
        # one optimiser step (SPEL on A, AdamW on the table) after global-norm clipping that counts the replicated
        # copies once; then A, the table and the codebooks must be the same on every TP rank
        out["norm"] = clip_grad_norm_(list(model.parameters()), 0.5, ctx.tp_pg, ctx.pp_pg)
        build_optimizer(model, cfg.optimizer, ctx.tp_pg).step()
        out["after"] = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
                        if ".projection." in n or ".quantizer." in n}
        results[case] = out
    return results


def _pp_bytes(results: list, op: str) -> int:
    return sum(r["comm"].get("pp", {}).get(op, {}).get("bytes", 0) for r in results)


@pytest.mark.slow
def test_btp_mapl_at_tp_2_equals_tp_1_with_the_same_link_bytes() -> None:
    """svd + plain MAPL and cola + MAPL with RVQ (both cases in the same processes: spawning dominates)."""
    ones = run_distributed(_btp_worker, 2, 1, {})
    references = {case: {n: g for r in ones for n, g in r[case]["grads"].items()} for case in CASES}
    twos = run_distributed(_btp_worker, 4, 2, references)
    tokens, d = N_MICRO * MB * SEQ, MODEL["hidden_size"]
    distinct = _batch()[:, :-1].unique().numel()  # U: the anchor rows the step touched
    for case, (_, codec) in CASES.items():
        one, two = [r[case] for r in ones], [r[case] for r in twos]
        assert any(n.endswith(".A") for r in two for n in r["names"])
        assert {n for r in two for n in r["names"]} == set(references[case])  # every parameter compared
        for r in two:
            assert abs(r["loss"] - one[-1]["loss"]) <= 1e-5 * abs(one[-1]["loss"]), case
            assert r["worst"] <= 1e-5, (case, r["worst_name"], r["worst"])
        closed = {"send:codec_grads:fwd": d * MR * 4, "send:codec_grads:bwd": (d * MR + distinct * MM) * 4}
        if codec is PLAIN:  # r fp32 columns + one int32 id column per token, each way
            closed.update({"send:fwd": tokens * (MR + 1) * 4, "send:bwd": tokens * (MR + 1) * 4})
        for op, n in closed.items():  # tp = 2: each TP rank sends half of each (even) message
            assert _pp_bytes(one, op) == n, (case, op, one[0]["comm"])
            assert _pp_bytes(two, op) == n, (case, op, two[0]["comm"])
        for op in ("send:fwd", "send:bwd"):  # RVQ: its own widths (tests/test_mapl_rvq.py), the same at tp = 2
            assert _pp_bytes(two, op) == _pp_bytes(one, op) > 0, (case, op)
        # RVQ's state after the sender's k-means step and the streamed row: bit-identical over TP, tp = 1's values
        assert bool(two[0]["codebooks"]) == (codec is RVQ)
        for r in two:  # the global norm clipping saw: the replicated copies counted once, as at tp = 1
            assert r["norm"] == two[0]["norm"] and abs(r["norm"] - one[0]["norm"]) <= 1e-5 * one[0]["norm"], case
        for suffix in ("projection.A", "projection.anchor_table"):  # both pipeline copies, every TP rank
            copies = [t for r in two for n, t in r["after"].items() if n.endswith(suffix)]
            assert len(copies) == 4 and all(torch.equal(t, copies[0]) for t in copies), (case, suffix)
        for r in two:
            same_tp = next(o for o in two if o["pp_rank"] == r["pp_rank"])
            assert r["after"].keys() == same_tp["after"].keys() and any(n.endswith(".A") for n in r["after"])
            for name, t in r["after"].items():  # the identical step on every TP rank
                assert torch.equal(t, same_tp["after"][name]), (case, name)
            same_pp = next(o for o in one if o["pp_rank"] == r["pp_rank"])
            for name, buf in r["codebooks"].items():
                assert torch.equal(buf, same_tp["codebooks"][name]), (case, name)
                torch.testing.assert_close(buf, same_pp["codebooks"][name], rtol=1e-5, atol=1e-6)
