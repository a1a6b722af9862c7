"""The composed test matrix of issue 17 ("Three bandwidth tiers in one run"):
{megatron, btp} x {identity, resbm, subspace, mapl} x {allreduce, sparseloco, heterogeneous sparseloco}, on a
4-layer d = 32 Llama (btp: BOOST SVD low rank, r = 8; megatron: full rank), every codec at the stage boundary of
pp = 2 (after layer 1; `model.codec.boundaries: [1]`, the same layer in the references).

Which cells run. A cell's fate is the config loader's (`cell_config` / `dp_cell_config`: `from_dict` and
`Config.validate`), never a list written here: a cell whose config is refused is skipped with the loader's one
line, so a combination that starts to compose (btp x mapl, btp x subspace) is checked as soon as it loads.

1. TP x codec (`test_tp2_pp2_step_equals_float64_reference[strategy-codec]`, 8 cells, ONE 4-process spawn): one
   optimiser-free 1F1B step at dp = 1 x tp = 2 x pp = 2 (2 micro-batches). Reference: the same composed config
   built on one process (tp = pp = 1, same seed: the init is layout-independent), cast to float64
   (`.double()`; codecs keep float64 across a boundary, codecs/base.py), on the same batch, computed by rank 0
   in the same spawn. Checked: loss and every parameter's gradient (TP shards gathered) within 1e-5 relative;
   the ledger against the closed forms (`Technique.closed_form_bytes`, nanotron_ext.metrics.tier_bytes): PP
   bytes of the boundary exactly (MAPL: the wire and its shared-parameter sync, each once over TP, exactly
   forward; the sync's backward rows depend on the ids a step touched, bounded by the form); TP all-reduce
   bytes exactly: Megatron's form (with the Subspace split embedding's k-wide all-reduce in place of its d-wide
   one), BTP's Table 6 form plus what it leaves out (the blocks' RMSNorm sums of squares, the head's input
   gradient, the cross-entropy's statistics) plus the codec's own per-shard all-reduces under btp (ResBM's
   sharded E/D, Subspace's Z / dZ, split embedding and span(U) constraint, MAPL's Z / dZ), written out in
   `_check_closed_forms` (no technique's closed_form_bytes counts them). All 8 cells load on main as of
   2026-11-25 (btp x subspace and btp x mapl landed while this file was written; before, the loader skipped
   them with its one line).
2. x DP sync (dp = 2 x tp = 2 x pp = 2, ONE 8-process spawn, one cell per DP sync: the DP sync acts on whatever
   parameters the TP x codec model has, which part 1 checks cell by cell, so 8 processes per cell would buy
   little; each DP cell runs btp where its config loads, else megatron, and the loader's refusal of btp is the
   reason for the fallback):
   - allreduce x mapl (`..._allreduce_mapl_...`): one step, each replica on its half of a
     global batch; reference: the float64 single-process model's gradient on the whole batch, every rank within
     1e-5; DP bytes: the dense form (4 B per distinct parameter) + each TP rank's copy of a TP-replicated
     parameter + one fp32 loss per rank.
   - sparseloco x resbm: H = 2 trainer steps (Replica: AdamW, clipping) per replica on its own
     batches, then the outer sync; reference: the other replica (bit-identical parameters on every (TP, PP)
     rank after the sync). DP bytes: outer_sync_bytes of each rank's tensors (a TP shard chunks on its own)
     + one fp32 loss per rank and step; `config show`'s form (the unsharded model) is below that at tp = 2.
   - heterogeneous sparseloco: as sparseloco; replica 0 runs the subspace codec, replica 1 the identity.
   All three run btp on main as of 2026-11-25.
   Pruned as meaningless: heterogeneous sparseloco x {identity, resbm, subspace, mapl}: heterogeneous SparseLoCo
   chooses each replica's codec itself (subspace on compressed replicas, identity on the others; the loader
   refuses `model.codec.kind` with it), so the codec axis collapses to one cell (`het_sparseloco-own_codec`).
   Not run for the time budget: the other 2 x 4 x 2 (strategy x codec x {allreduce, sparseloco}) cells, whose
   model part 1 checks and whose DP sync the two cells above check.
   Not compared: the simulated replicas (nanotron_ext.sparseloco.simulate): current tests compare them with the
   distributed mode at tp = pp = 1 only (bit for bit), where both sum in the same order; at tp = 2 the TP sums
   round differently and SparseLoCo's top-k selection is discontinuous, so no exact comparison exists.

Measured (`pytest -p no:xdist -q tests/test_composed_matrix.py`, 11 passed, 2026-11-25, the shared 2-core
machine, never quiet): 41-45 s wall at load average ~8; 43 CPU-seconds in all (the 8-process spawn 24, the
4-process spawn 12, the parent's imports and configs 7). With 6 TP x codec cells it took 82 s at load ~10 and
115-125 s at load 16-19.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from nanotron_ext.config import ConfigError
from nanotron_ext.config.schema import Config
from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_rows, full_gradients, micro_batches, one_step, small_config

STRATEGIES = ("megatron", "btp")
CODECS = ("identity", "resbm", "subspace", "mapl")
MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16,
             tie_embeddings=False)
CODEC = {  # each codec at the stage boundary of pp = 2 (after layer 1 of 4), at the same layer in the reference
    "identity": {"kind": "identity"},
    "resbm": {"kind": "resbm", "resbm": {"h": 12, "m": 10, "norm": "both", "zero_init_encoder": False}},
    "subspace": {"kind": "subspace"},
    "mapl": {"kind": "mapl", "mapl": {"rank": 8}},
}
BOUNDARY = 1
SEQ, MB, N_MICRO, SEED = 8, 2, 2, 7
REL = 1e-5  # loss and every gradient, relative to the float64 reference


def _model(strategy: str, codec: Optional[str]) -> Dict:
    """The model section; codec None: no model.codec.kind (heterogeneous SparseLoCo chooses it per replica)."""
    model: Dict = {**MODEL, "codec": {**(CODEC[codec] if codec else {}), "boundaries": [BOUNDARY]},
                   "subspace": {"k": 8}}
    if strategy == "btp":  # BOOST's BTP shards a low-rank model's bottleneck
        model.update(tp_strategy="btp", low_rank={"kind": "svd", "rank": 8})
    return model


def cell_config(strategy: str, codec: str, dp: int = 1, tp: int = 2, pp: int = 2) -> Config:
    """The composed config of one cell through the strict loader and every rule it runs (Config.validate with the
    world size): a combination that does not compose raises ConfigError with the loader's one line."""
    cfg = small_config(_model(strategy, codec), dp=dp, tp=tp, pp=pp, seq=SEQ, mb=MB, n_micro=N_MICRO)
    cfg.validate(world_size=dp * tp * pp)
    return cfg


def refusal(strategy: str, codec: str) -> Optional[str]:
    """The loader's one-line reason why this cell does not compose at tp = 2 x pp = 2 (None: it loads)."""
    try:
        cell_config(strategy, codec)
    except ConfigError as err:
        return str(err)
    return None


def _batch(rows: int, seed: int = SEED) -> torch.Tensor:
    return fixed_rows(rows, SEQ, seed=seed)


def _reference(cfg: Config, ctx, rows: torch.Tensor) -> dict:
    """The same composed model on one process (tp = pp = 1, the codec at the same layer), same seed, cast to
    float64, one forward/backward of the mean loss over `rows` (all micro-batches at once: equal sizes, so the
    mean of the micro-batch means)."""
    import dataclasses

    from nanotron_ext.models.build import build_model

    ref_cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, dp=1, tp=1, pp=1))
    model = build_model(ref_cfg, ctx).double()
    loss = model(input_ids=rows[:, :-1], label_ids=rows[:, 1:])["loss"]
    loss.backward()
    model.after_backward()  # MAPL: the encoder's and decoder's copies of the shared parameters combine
    return {"loss": loss.item(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


# -- TP x codec: one step at tp = 2 x pp = 2 against the float64 single-process model ---------------------------
def _tp_codec_worker(cells: List[Tuple[str, str]]) -> dict:
    """All cells in the same 4 processes: each cell's model at dp = 1 x tp = 2 x pp = 2, one 1F1B step (loss, full
    gradients, the ledger); rank 0 also runs the float64 reference (a dp = 4 x tp = 1 x pp = 1 context on the same
    processes: one-rank TP and PP groups, and the reference step does no DP collective)."""
    import torch.distributed as torch_dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=2, pp=2, backend="gloo")
    ref_ctx = build_parallel_context(dp=4, tp=1, pp=1, backend="gloo")
    rows = _batch(N_MICRO * MB)
    out: dict = {"pp_rank": torch_dist.get_rank(ctx.pp_pg)}
    for strategy, codec in cells:
        cfg = cell_config(strategy, codec)
        model = build_model(cfg, ctx)
        loss, comm = one_step(model, micro_batches(rows, MB), ctx)
        out[strategy, codec] = {"loss": loss, "grads": full_gradients(model, ctx.tp_pg), "comm": comm}
        if torch_dist.get_rank() == 0:
            out[strategy, codec]["ref"] = _reference(cfg, ref_ctx, rows)
    return out


@functools.lru_cache(maxsize=None)
def _tp_codec_results() -> Tuple[list, Dict[Tuple[str, str], Optional[str]]]:
    """One 4-process spawn for every TP x codec cell that loads; the refused ones with the loader's reason."""
    fate = {(s, c): refusal(s, c) for s in STRATEGIES for c in CODECS}
    cells = [cell for cell, reason in fate.items() if reason is None]
    return run_distributed(_tp_codec_worker, 4, cells, timeout_s=600), fate


def _ledger(results: list, group: str, op_filter) -> int:
    return sum(c["bytes"] for r in results for op, c in r["comm"].get(group, {}).items() if op_filter(op))


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tp2_pp2_step_equals_float64_reference(strategy: str, codec: str) -> None:
    """Loss and every parameter's gradient (TP shards gathered) of one step at tp = 2 x pp = 2 equal the float64
    single-process model's within 1e-5 relative; the ledger's bytes per group equal the closed forms."""
    all_results, fate = _tp_codec_results()
    if fate[strategy, codec] is not None:
        pytest.skip(fate[strategy, codec])
    results = [r[strategy, codec] for r in all_results]
    ref = results[0]["ref"]
    loss = results[-1]["loss"]  # the last stage's
    assert abs(loss - ref["loss"]) <= REL * abs(ref["loss"]), (loss, ref["loss"])
    got = {n: g for r in results for n, g in r["grads"].items()}
    assert got.keys() == ref["grads"].keys(), sorted(got.keys() ^ ref["grads"].keys())
    errors = {n: _relative(g, ref["grads"][n]) for n, g in got.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= REL, (worst, errors[worst])
    _check_closed_forms(cell_config(strategy, codec), results)


def _check_closed_forms(cfg: Config, results: list) -> None:
    """The ledger of the step against `config show`'s closed forms (Technique.closed_form_bytes, the owner of each
    piece). PP: the one boundary's bytes, both directions, summed over the TP ranks. TP: each TP rank's all-reduce
    payload summed over both stages (the 4 ranks hold twice that)."""
    from nanotron_ext.registry import CODECS as CODEC_OWNERS
    from nanotron_ext.registry import TP_STRATEGIES

    m, kind, strategy = cfg.model, cfg.model.codec.kind, cfg.model.tp_strategy
    bs, n, e, tp_size = MB * SEQ, N_MICRO, 4, cfg.parallelism.tp
    pp = CODEC_OWNERS.owner(kind).closed_form_bytes("model.codec.kind", kind, cfg)
    sent = {op: _ledger(results, "pp", lambda o, op=op: o == op)
            for op in ("send:fwd", "send:bwd", "send:codec_grads:fwd", "send:codec_grads:bwd")}
    if kind == "mapl":
        # the wire plus the shared-parameter sync (each once over TP), whose backward rows depend on the ids a step
        # touched (the form bounds them)
        assert sent["send:fwd"] + sent["send:codec_grads:fwd"] == pp.forward, (pp, sent)
        assert sent["send:bwd"] < sent["send:bwd"] + sent["send:codec_grads:bwd"] <= pp.backward, (pp, sent)
    else:
        assert (sent["send:fwd"], sent["send:bwd"]) == (pp.forward, pp.backward), (pp, sent)
    tp = TP_STRATEGIES.owner(strategy).closed_form_bytes("model.tp_strategy", strategy, cfg)
    expected = tp.total
    if strategy == "megatron" and m.embedding.kind == "subspace":
        expected -= n * e * bs * (m.hidden_size - m.subspace.k)  # its vocab-sharded T_S all-reduces k values, not d
    if strategy == "btp":
        # what BOOST's Table 6 leaves out, counted here: each block's two RMSNorm sums of squares over the d-shards
        # (b s each), the head's input gradient (b s d) and the sharded cross-entropy's 3 b s
        expected += n * e * (2 * m.num_layers * bs + bs * m.hidden_size + 3 * bs)
        if kind == "resbm":  # its sharded E/D: [trunc_h, W1 x, sum of squares] forward, [db, da] backward
            h, width = m.codec.resbm.h, m.codec.resbm.m
            expected += n * e * bs * ((h + width + 1) + (h + width))
        if kind == "subspace":  # per feature shard (subspace/codec.py, embedding.py, constraints.py), all k-wide:
            k, r = m.subspace.k, m.low_rank.rank
            expected += n * e * (2 * bs * k  # the codec: Z's partial sums forward, dZ backward
                                 + bs * k  # the split embedding: dT_S[ids] summed over the shards, backward
                                 + 2 * m.num_layers * k * r)  # span(U): dC of each block's two output up-factors
        if kind == "mapl":  # per feature shard (mapl/codec.py): Z's r-wide partial sums forward, dZ backward
            expected += n * e * 2 * bs * m.codec.mapl.rank
    assert _ledger(results, "tp", lambda op: op == "all_reduce") == tp_size * expected, (tp, results[0]["comm"]["tp"])


# -- x DP sync: dp = 2 x tp = 2 x pp = 2, one cell per DP sync -------------------------------------------------
SYNCS = ("allreduce", "sparseloco", "het_sparseloco")
DP_CODEC = {"allreduce": "mapl", "sparseloco": "resbm", "het_sparseloco": None}  # None: the replicas' own codec
SPARSELOCO = {"inner_steps": 2, "topk": 8}


def dp_cell_config(strategy: str, sync: str) -> Config:
    """The DP cell's config at dp = 2 x tp = 2 x pp = 2 through the loader's rules (ConfigError if refused).
    Heterogeneous SparseLoCo: no model.codec.kind (it picks subspace for replica 0, identity for replica 1), its
    compressed replica's subspace codec at the same boundary."""
    sections = {}
    if sync != "allreduce":
        sections["sparseloco"] = {**SPARSELOCO, "compressed_replicas": [0] if sync == "het_sparseloco" else []}
    cfg = small_config(_model(strategy, DP_CODEC[sync]), dp=2, tp=2, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO,
                       parallelism={"dp_sync": sync.removeprefix("het_")}, tokens={"train_steps": 4}, **sections)
    cfg.validate(world_size=8)
    return cfg


def dp_cell(sync: str) -> Tuple[Optional[str], List[str]]:
    """The strategy this DP sync's cell runs with: btp where its config loads, else megatron; and the loader's
    reasons for what it refused."""
    refused = []
    for strategy in ("btp", "megatron"):
        try:
            dp_cell_config(strategy, sync)
            return strategy, refused
        except ConfigError as err:
            refused.append(str(err))
    return None, refused


def _local_params(model: torch.nn.Module) -> dict:
    """This rank's trainable parameters: their shapes, and the numel of those replicated over TP."""
    params = [p for p in model.parameters() if p.requires_grad]
    replicated = sum(p.numel() for p in params
                     if not (getattr(p, "is_sharded", False) and len(p.get_sharded_info().global_ranks) > 1))
    return {"shapes": [tuple(p.shape) for p in params], "replicated": replicated}


def _dp_worker(cells: List[Tuple[str, str]]) -> dict:
    """Every DP cell in the same 8 processes. allreduce: one step (no optimiser) on this replica's half of a global
    batch, rank 0 also the float64 reference on the whole batch. SparseLoCo: the trainer's step (Replica: AdamW,
    clipping) for H = 2 steps on per-replica batches, then the outer sync; the parameters and buffers after it."""
    import torch.distributed as torch_dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.replica import Replica

    ctx = build_parallel_context(dp=2, tp=2, pp=2, backend="gloo")
    ref_ctx = build_parallel_context(dp=8, tp=1, pp=1, backend="gloo")
    dp_rank = torch_dist.get_rank(ctx.dp_pg)
    out: dict = {"dp_rank": dp_rank, "pp_rank": torch_dist.get_rank(ctx.pp_pg),
                 "tp_rank": torch_dist.get_rank(ctx.tp_pg)}
    ledger = get_ledger()
    for strategy, sync in cells:
        cfg = dp_cell_config(strategy, sync)
        if sync == "allreduce":
            rows = _batch(2 * N_MICRO * MB)
            model = build_model(cfg, ctx)
            loss, comm = one_step(model, micro_batches(rows.chunk(2)[dp_rank], MB), ctx)
            res = {"loss": loss, "grads": full_gradients(model, ctx.tp_pg), "comm": comm, **_local_params(model)}
            if torch_dist.get_rank() == 0:
                res["ref"] = _reference(cfg, ref_ctx, rows)
        else:
            replica = Replica(cfg, ctx, dp_rank)
            ledger.reset()
            for step in (1, 2):
                loss = replica.backward(micro_batches(_batch(N_MICRO * MB, seed=100 * step + dp_rank), MB))
                replica.update(step, loss.item())
            res = {"codec": replica.model_cfg.model.codec.kind, "comm": ledger.snapshot(),
                   "state": {k: v.detach().clone() for k, v in replica.model.state_dict().items()},
                   **_local_params(replica.model)}
        out[sync] = res
    return out


@functools.lru_cache(maxsize=None)
def _dp_results() -> list:
    cells = [(dp_cell(sync)[0], sync) for sync in SYNCS if dp_cell(sync)[0] is not None]
    return run_distributed(_dp_worker, 8, cells, timeout_s=600)


def _dp_ledger(results: list, sync: str, replica: int) -> Dict[str, int]:
    """One replica's DP bytes by op, summed over its TP and PP ranks."""
    out: Dict[str, int] = {}
    for r in results:
        if r["dp_rank"] == replica:
            for op, c in r[sync]["comm"].get("dp", {}).items():
                out[op] = out.get(op, 0) + c["bytes"]
    return out


def _dp_form(cfg: Config):
    from nanotron_ext.registry import DP_SYNCS

    return DP_SYNCS.owner(cfg.parallelism.dp_sync).closed_form_bytes("parallelism.dp_sync",
                                                                     cfg.parallelism.dp_sync, cfg)


@pytest.mark.slow
def test_dp2_allreduce_mapl_gradient_equals_float64_reference_on_the_global_batch() -> None:
    """Each replica steps on its half of the global batch; after the DP all-reduce every rank's gradients (TP shards
    gathered) equal the float64 single-process model's on the whole batch, and each replica all-reduces the
    closed form's bytes (4 B per parameter)."""
    strategy, refused = dp_cell("allreduce")
    if strategy is None:
        pytest.skip(" / ".join(refused))
    results = _dp_results()
    ref = results[0]["allreduce"]["ref"]
    for replica in (0, 1):
        names = {n for r in results if r["dp_rank"] == replica for n in r["allreduce"]["grads"]}
        assert names == ref["grads"].keys(), sorted(names ^ ref["grads"].keys())
    for r in results:
        grads = r["allreduce"]["grads"]
        errors = {n: _relative(g, ref["grads"][n]) for n, g in grads.items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= REL, (strategy, r["dp_rank"], worst, errors[worst])
    last = [r["allreduce"]["loss"] for r in results if r["pp_rank"] == 1]
    assert all(abs(loss - ref["loss"]) <= REL * abs(ref["loss"]) for loss in last), (last, ref["loss"])
    # dense all-reduce (tier_bytes.dense_dp): 4 B per distinct parameter. Each TP rank all-reduces its own copy of a
    # TP-replicated parameter, which the form counts once; and each rank all-reduces its loss (one fp32) over DP
    form, tp_size = _dp_form(dp_cell_config(strategy, "allreduce")), 2
    for replica in (0, 1):
        ranks = [r["allreduce"] for r in results if r["dp_rank"] == replica]
        extra = 4 * sum(r["replicated"] for r in ranks) * (tp_size - 1) // tp_size + 4 * len(ranks)
        assert _dp_ledger(results, "allreduce", replica) == {"all_reduce": form.total + extra}, (form, extra)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["sparseloco", "het_sparseloco"], ids=["sparseloco-resbm", "het_sparseloco-own_codec"])
def test_dp2_sparseloco_replicas_identical_after_the_outer_sync(sync: str) -> None:
    """H = 2 trainer steps on each replica's own batches, then one outer sync: both replicas hold the same
    parameters bit for bit on every (TP, PP) rank (heterogeneous: replica 0 runs the subspace codec, replica 1 the
    identity; codec-side counters aside), and each replica's DP bytes equal the closed form x H."""
    strategy, refused = dp_cell(sync)
    if strategy is None:
        pytest.skip(" / ".join(refused))
    results = _dp_results()
    by_replica: Dict[int, list] = {}
    for r in results:
        by_replica.setdefault(r["dp_rank"], []).append(r)
    if sync == "het_sparseloco":
        assert {r[sync]["codec"] for r in by_replica[0]} == {"subspace"}
        assert {r[sync]["codec"] for r in by_replica[1]} == {"identity"}
    for a, b in zip(by_replica[0], by_replica[1]):  # the same (TP, PP) rank of the two replicas
        assert (a["tp_rank"], a["pp_rank"]) == (b["tp_rank"], b["pp_rank"])
        shared = [k for k in b[sync]["state"] if k in a[sync]["state"] and not k.endswith(("grad_gram", "hub.steps"))]
        assert len(shared) >= 5
        for k in shared:
            assert torch.equal(a[sync]["state"][k], b[sync]["state"][k]), (strategy, k)
    # one all_gather of each rank's payload per outer sync: outer_sync_bytes of the tensors it holds (a TP shard is
    # its own tensor, chunked on its own; a TP-replicated one goes from every TP rank), and one fp32 loss per rank
    # and step. `config show`'s form (Technique.closed_form_bytes) applies outer_sync_bytes to the unsharded model:
    # exact at tp = 1, below the ledger at tp = 2
    from nanotron_ext.sparseloco.accounting import outer_sync_bytes

    cfg = dp_cell_config(strategy, sync)
    form, steps = _dp_form(cfg), cfg.sparseloco.inner_steps
    for replica in (0, 1):
        ranks = [r[sync] for r in results if r["dp_rank"] == replica]
        payload = sum(outer_sync_bytes(r["shapes"], cfg.sparseloco) for r in ranks)
        assert _dp_ledger(results, sync, replica) == {"all_gather": payload, "all_reduce": 4 * len(ranks) * steps}
        assert form.total * steps < payload, form
