"""Three bandwidth tiers in one job (issue 17): {megatron, btp} x {identity, resbm, subspace, mapl} x
{allreduce, sparseloco, heterogeneous sparseloco} at dp = 2 x tp = 2 x pp = 2. Every combination either
loads or fails at config load with one line naming both keys (exit 2 from the command line), never as a
traceback from a rank that builds the model."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional

import pytest
import torch

from nanotron_ext.config import ConfigError, load_config
from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_micro_batches, one_step, small_config

REPO = Path(__file__).resolve().parents[1]
# d = 128, 4 layers, dp = 2, pp = 2, compressed_replicas [0]
HET = REPO / "examples" / "config_tiny_het_sparseloco.yaml"

STRATEGIES = ("megatron", "btp")
CODECS = ("identity", "resbm", "subspace", "mapl")
SYNCS = ("allreduce", "sparseloco", "het_sparseloco")


def overrides(strategy: str, codec: str, sync: str, tp: int = 2) -> List[str]:
    sets = [f"parallelism.tp={tp}", "parallelism.pp=2", "parallelism.dp=2", f"model.codec.kind={codec}"]
    if strategy == "btp":
        sets += ["model.low_rank.kind=cola", "model.tp_strategy=btp"]
    if sync == "allreduce":
        sets += ["parallelism.dp_sync=allreduce", "sparseloco=null"]
    elif sync == "sparseloco":
        sets += ["sparseloco.compressed_replicas=[]"]
    return sets


def refusal(strategy: str, codec: str, sync: str) -> Optional[str]:
    """What the config loader must say about this combination at tp = 2 (None: it loads). Written from the
    techniques' constraints, not read back from the loader."""
    if sync == "het_sparseloco" and codec != "identity":
        # meaningless: heterogeneous SparseLoCo sets each replica's codec itself (subspace or none)
        return (f"model.codec.kind: '{codec}': with sparseloco.compressed_replicas the per-replica model is set by "
                "sparseloco")
    return None  # every codec composes with btp at tp = 2 (ResBM, MAPL, Subspace per feature shard)


MATRIX = list(itertools.product(STRATEGIES, CODECS, SYNCS))


@pytest.mark.parametrize("strategy,codec,sync", MATRIX)
def test_every_combination_loads_or_fails_at_load_naming_both_keys(strategy: str, codec: str, sync: str) -> None:
    expected = refusal(strategy, codec, sync)
    if expected is None:
        cfg = load_config(HET, overrides(strategy, codec, sync))
        assert (cfg.model.codec.kind, cfg.parallelism.tp) == (codec, 2)
        return
    with pytest.raises(ConfigError) as e:
        load_config(HET, overrides(strategy, codec, sync))
    message = str(e.value)
    assert "\n" not in message and all(part in message for part in expected.split("|")), message


def test_the_sharded_residual_rule_leaves_tp_1_alone() -> None:
    """At tp = 1 BTP's shard is the whole residual stream: the rule does not refuse (the layout BOOST's own
    tests and the het example with a low-rank model use)."""
    for codec, sync in (("identity", "het_sparseloco"), ("resbm", "allreduce")):
        cfg = load_config(HET, overrides("btp", codec, sync, tp=1))
        assert (cfg.model.tp_strategy, cfg.parallelism.tp, cfg.model.codec.kind) == ("btp", 1, codec)


GRASSMANN = ["model.subspace.grassmann_every=2"]
SHARDED_GRASSMANN = ("model.subspace.grassmann_every: 2 cannot run with model.tp_strategy='btp' at parallelism.tp=2"
                     "|model.tp_strategy")


@pytest.mark.parametrize("strategy,codec,sync,extra", [("megatron", "resbm", "het_sparseloco", []),
                                                       ("btp", "subspace", "allreduce", GRASSMANN)])
def test_command_line_prints_one_line_and_exits_2(strategy: str, codec: str, sync: str, extra: List[str]) -> None:
    """Refused combinations give one line, exit 2 (ResBM under BTP was a per-rank traceback before it composed);
    Subspace Models' Grassmann updates under BTP need the whole d-wide residual gradient on one rank."""
    out = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "show", "--config-file", str(HET),
                          *[a for kv in overrides(strategy, codec, sync) + extra for a in ("--set", kv)]],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    expected = refusal(strategy, codec, sync) or SHARDED_GRASSMANN
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert all(part in out.stderr for part in expected.split("|")), out.stderr


# -- the slow link carries each wire once (parallelism.pp_scatter_gather) --------------------------------------
SMALL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16,
             tie_embeddings=False)
SEQ, MB, N_MICRO = 8, 2, 2


def _wire_worker(tp: int, pp: int, codec: dict, scatter_gather: bool, model: Optional[dict] = None) -> dict:
    """One step of the composed model on a fixed batch: loss, this rank's gradients (by name), the ledger."""
    import nanotron.distributed as dist

    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=tp, pp=pp, backend="gloo")
    cfg = small_config({**(model or SMALL), "codec": codec}, tp=tp, pp=pp, seq=SEQ, mb=MB, n_micro=N_MICRO,
                       parallelism={"pp_scatter_gather": scatter_gather})
    model = build_model(cfg, ctx)
    loss, comm = one_step(model, fixed_micro_batches(N_MICRO, MB, SEQ), ctx)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads, "comm": comm, "pp_rank": dist.get_rank(ctx.pp_pg)}


def _pp_bytes(results: list, op: str) -> int:
    return sum(r["comm"].get("pp", {}).get(op, {}).get("bytes", 0) for r in results)


RVQ = {"kind": "mapl", "mapl": {"rank": 8, "anchor_width": 4, "vq_groups": 2, "vq_rounds": 2, "vq_codebook": 16,
                                 "grad_bits": 8}}  # token ids packed in the wire, a forward narrower than its gradient


@pytest.mark.slow
@pytest.mark.parametrize("codec", [{"kind": "identity"}, {"kind": "resbm", "resbm": {"ratio": 4}}, RVQ],
                         ids=["identity", "resbm", "mapl_rvq"])
def test_the_slow_link_carries_each_megatron_wire_once(codec: dict) -> None:
    """Megatron TP (the wire is the same on every TP rank): pipeline bytes per boundary at tp = 2 equal tp = 1's,
    the receiving stage's TP all-gather is counted in the tp group, and the loss and every gradient are
    bit-identical to the run in which every TP rank sends its own copy (pp_scatter_gather=false, twice the
    pipeline bytes)."""
    from tests.helpers.dist import run_distributed

    one = run_distributed(_wire_worker, 2, 1, 2, codec, True)
    once = run_distributed(_wire_worker, 4, 2, 2, codec, True)
    copies = run_distributed(_wire_worker, 4, 2, 2, codec, False)
    width = {"identity": SMALL["hidden_size"], "resbm": SMALL["hidden_size"] // 4}.get(codec["kind"])  # h = d / ratio
    boundary = N_MICRO * MB * SEQ * width * 4 if width else _pp_bytes(one, "send:fwd")  # fp32, per step: closed form
    for op in ("send:fwd", "recv:fwd", "send:bwd", "recv:bwd"):  # (MAPL-RVQ's forward and backward widths differ)
        boundary = boundary if width or op.endswith("fwd") else _pp_bytes(one, "send:bwd")
        assert _pp_bytes(one, op) == boundary, (op, one[0]["comm"])
        assert _pp_bytes(once, op) == boundary, (op, once[0]["comm"])
        assert _pp_bytes(copies, op) == 2 * boundary, (op, copies[0]["comm"])
    gathered = sum(r["comm"].get("tp", {}).get("all_gather:pp-wire", {}).get("bytes", 0) for r in once)
    assert gathered == _pp_bytes(one, "send:fwd") + _pp_bytes(one, "send:bwd")  # each receiving TP rank's half
    assert not any("all_gather:pp-wire" in r["comm"].get("tp", {}) for r in copies)
    for a, b in zip(once, copies):
        assert a["loss"] == b["loss"] and a["grads"].keys() == b["grads"].keys()
        for name, g in a["grads"].items():
            assert torch.equal(g, b["grads"][name]), name
    assert abs(once[-1]["loss"] - one[-1]["loss"]) <= 1e-5 * abs(one[-1]["loss"])
    # MAPL's shared-parameter exchange is side traffic on the same link: once over TP too (each TP rank 1/tp)
    sync = [_ledger_sum(run, "pp", lambda op: op.startswith("send:codec_grads")) for run in (one, once, copies)]
    assert sync[1] == sync[0] and sync[2] == 2 * sync[0], sync
    _check_closed_forms(codec, one, once)


def _ledger_sum(results: list, group: str, keep: Callable[[str], bool]) -> int:
    return sum(c["bytes"] for r in results for op, c in r["comm"].get(group, {}).items() if keep(op))


def _check_closed_forms(codec: dict, one: list, once: list) -> None:
    """`config show`'s closed forms (Technique.closed_form_bytes) against what the ledger measured: the PP
    tier's bytes per boundary and step each way (MAPL: the wire plus the shared-parameter sync, whose
    backward rows depend on how many distinct ids a step touched, so the form bounds it), and Megatron's TP
    all-reduces of one TP rank over both stages."""
    from nanotron_ext.registry import CODECS, TP_STRATEGIES

    cfg = small_config({**SMALL, "codec": codec}, tp=2, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO)
    pp = CODECS.owner(codec["kind"]).closed_form_bytes("model.codec.kind", codec["kind"], cfg)
    sent_fwd = _ledger_sum(one, "pp", lambda op: op.startswith("send") and op.endswith("fwd"))
    sent_bwd = _ledger_sum(one, "pp", lambda op: op.startswith("send") and op.endswith("bwd"))
    assert pp.forward == sent_fwd, (pp, one[0]["comm"])
    if codec["kind"] == "mapl":
        assert _pp_bytes(one, "send:bwd") < sent_bwd <= pp.backward, (pp, one[-1]["comm"])
    else:
        assert pp.backward == sent_bwd, (pp, one[-1]["comm"])
        tp = TP_STRATEGIES.owner("megatron").closed_form_bytes("model.tp_strategy", "megatron", cfg)
        assert 2 * tp.total == _ledger_sum(once, "tp", lambda op: op == "all_reduce"), (tp, once[0]["comm"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["megatron", "btp"])
def test_the_job_pp_form_matches_the_ledger_when_every_tp_rank_sends(strategy: str) -> None:
    """parallelism.pp_scatter_gather=false at tp = 2 x pp = 2, identity wire: Megatron's replicated wire crosses
    once per TP rank (twice), btp's sharded one once in all (each TP rank its d/tp shard); the WAN meter's job
    form (config.tiers.job_bytes_per_step) equals the pipeline bytes every rank's ledger sent."""
    from nanotron_ext.config.tiers import job_bytes_per_step
    from tests.helpers.dist import run_distributed

    model = {**SMALL, "tp_strategy": strategy, **({"low_rank": {"kind": "svd"}} if strategy == "btp" else {})}
    runs = run_distributed(_wire_worker, 4, 2, 2, {"kind": "identity"}, False, model)
    cfg = small_config(model, tp=2, pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO, parallelism={"pp_scatter_gather": False})
    sent = _pp_bytes(runs, "send:fwd") + _pp_bytes(runs, "send:bwd")  # the wire (shape headers aside)
    copies = 2 if strategy == "megatron" else 1
    assert sent == copies * 2 * N_MICRO * MB * SEQ * SMALL["hidden_size"] * 4, runs[0]["comm"]  # fp32, both ways
    assert job_bytes_per_step(cfg)["pp"] == sent


@pytest.mark.slow
def test_pp_bytes_at_tp_3_equal_tp_1_with_a_padded_wire() -> None:
    """tp = 3 and a ResBM wire of h = 10 (16 tokens x 10 = 160 values: each TP rank sends 54, the last two
    padded): pipeline bytes per boundary are tp = 1's up to that padding, and loss follows tp = 1's."""
    model = {**SMALL, "hidden_size": 48, "num_heads": 6, "num_kv_heads": 3, "ffn_size": 96, "vocab_size": 324}
    codec = {"kind": "resbm", "resbm": {"h": 10}}
    one = run_distributed(_wire_worker, 2, 1, 2, codec, True, model)
    three = run_distributed(_wire_worker, 6, 3, 2, codec, True, model)
    values = MB * SEQ * 10
    for op in ("send:fwd", "recv:fwd", "send:bwd", "recv:bwd"):
        assert _pp_bytes(one, op) == N_MICRO * values * 4, (op, one[0]["comm"])
        assert _pp_bytes(three, op) == N_MICRO * 3 * -(-values // 3) * 4, (op, three[0]["comm"])
    assert abs(three[-1]["loss"] - one[-1]["loss"]) <= 1e-5 * abs(one[-1]["loss"])


# -- heterogeneous SparseLoCo under TP (vocab-sharded T_S, replicated T_fixed) ---------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy,pp", [("megatron", 1), ("megatron", 2), ("btp", 1)])
def test_heterogeneous_sparseloco_dp2_tp2_replicas_identical_after_sync(small_corpus: Path, tmp_path: Path,
                                                                         strategy: str, pp: int) -> None:
    """dp = 2 x tp = 2 x pp (replica 0 compressed: the subspace codec after layer 1, the stage boundary at pp = 2),
    H = 2, 4 steps (2 outer syncs): after the last sync both replicas hold the same parameters bit for bit on each
    (TP, PP) rank, T_fixed is the same on every rank that holds it (the decoding stage's included), every TP
    rank's rows of T_S are back in span(U), and the losses follow the tp = 1 run's."""
    from tests.test_sparseloco_hetero import HET, _het_train_worker
    from tests.test_trainer import _losses, _small_overrides

    ovr = HET + ["model.codec.boundaries=[1]"]
    if strategy == "btp":  # the residual stream sharded on d: the codec, split table and constraint per shard
        ovr += ["model.tp_strategy=btp", "model.low_rank.kind=svd"]
    tp2 = run_distributed(_het_train_worker, 4 * pp,
                          _small_overrides(small_corpus, tmp_path / "tp2", 2, 2, pp, 4) + ovr,
                          None, 0, timeout_s=600)
    run_distributed(_het_train_worker, 2 * pp, _small_overrides(small_corpus, tmp_path / "tp1", 2, 1, pp, 4) + ovr,
                    None, 0, timeout_s=600)
    by = {}
    for r in tp2:
        by.setdefault(r["dp"], []).append(r)
    assert [r["codec"] for r in by[0]] == ["subspace"] * 2 * pp and [r["codec"] for r in by[1]] == ["identity"] * 2 * pp
    decoders = [r["state"][k] for r in by[0] for k in r["state"] if k.endswith("boundary_decoder.hub.fixed")]
    assert len(decoders) == 2 and all(torch.equal(f, tp2[0]["state"]["token_embedding.pp_block.embedding.hub.fixed"])
                                      for f in decoders)
    fixed = "token_embedding.pp_block.embedding.hub.fixed"
    table = "token_embedding.pp_block.embedding.table.weight"
    for a, b in zip(by[0], by[1]):  # the same (TP, PP) rank of the two replicas
        # codec-side counters
        shared = [k for k in b["state"] if k in a["state"] and not k.endswith(("grad_gram", "hub.steps"))]
        assert len(shared) >= 10
        for k in shared:
            assert torch.equal(a["state"][k], b["state"][k]), k
        if table not in a["state"]:
            continue  # a later stage
        u = a["state"]["token_embedding.pp_block.embedding.hub.basis"]
        t_s = a["state"][table]
        assert t_s.shape[0] * 2 == a["state"][fixed].shape[0]  # vocab-sharded T_S, whole T_fixed
        torch.testing.assert_close(t_s @ u @ u.T, t_s, rtol=0, atol=1e-5)
    assert all(torch.equal(r["state"][fixed], tp2[0]["state"][fixed]) for r in tp2 if fixed in r["state"])
    one, two = _losses(tmp_path / "tp1" / "tiny_llama"), _losses(tmp_path / "tp2" / "tiny_llama")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step][0] - two[step][0]) <= 1e-4 * abs(one[step][0]), (step, one[step], two[step])


def test_config_show_names_the_technique_of_every_tier() -> None:
    out = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "show", "--config-file",
                          str(REPO / "examples" / "config_three_tiers.yaml")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    tiers = out.stdout[out.stdout.index("# tiers:"):].splitlines()
    assert tiers == [
        "# tiers: dp=2 x tp=2 x pp=2",
        "#   TP (inside a stage, 2 ranks): btp (boost), low-rank svd",
        "#   PP (between stages, 1 links; 1 codec boundaries): subspace (subspace) on replicas [0], identity (core) on "
        "replicas [1]; each wire once over TP (parallelism.pp_scatter_gather); emulated 80 Mbit/s, 5 ms",
        "#   DP (between replicas, 2): sparseloco (sparseloco)",
        "# closed forms (nanotron_ext.metrics.tier_bytes; the comm ledger's bytes):",
        "#   TP bytes per step per TP rank, all stages: 7.00 MiB (forward 3.50 MiB, backward 3.50 MiB); BOOST Table 6: "
        "7 b s r per block and pass, x 4 blocks x 2 micro-batches; norm statistics, embedding and head left out",
        # forward 68 + 512 KiB: the two replicas' pipeline bytes the example measures (docs/three-tiers.md, "Three tiers
        # in one job"): 593,920 B each way per step
        "#   PP bytes per step per stage link (subspace, replicas [0]): 136.00 KiB (forward 68.00 KiB, backward "
        "68.00 KiB); k x 4 B + a 4 B token id (k = 16) per token each way x 1024 tokens per step",
        "#   PP bytes per step per stage link (identity, replicas [1]): 1.00 MiB (forward 512.00 KiB, backward "
        "512.00 KiB); d x 4 B per token each way x 1024 tokens per step",
        "#   DP bytes per step per replica: 3.77 KiB; top-32 of every 4096-chunk (12-bit indices, bf16 values): 38,640 "
        "B per outer sync / 10 inner steps; + the changed rows of T_fixed on compressed replicas (data-dependent); the "
        "unsharded model's tensors: at tp > 1 every TP rank compresses its own shards (more chunks) and sends its copy "
        "of replicated tensors, so the ledger reads more"]


def test_job_closed_forms_of_the_example_sum_its_tiers() -> None:
    """The WAN meter's closed-form column for examples/config_three_tiers.yaml, by hand: b s = 4 x 128 tokens,
    2 micro-batches, d = 128, r = 32, L = 4, fp32; replica 0 sends k = 16 values + a 4 B id per token, replica 1
    d values; BTP all-reduces 7 b s r per block and pass (BOOST Table 6)."""
    from nanotron_ext.config.tiers import job_bytes_per_step

    forms = job_bytes_per_step(load_config(REPO / "examples" / "config_three_tiers.yaml"))
    bs, d, n = 4 * 128, 128, 2
    assert forms["pp"] == 2 * n * bs * ((16 * 4 + 4) + d * 4)  # one stage link, both directions, both replicas
    assert forms["tp"] == 4 * n * 4 * 4 * 2 * 7 * bs * 32  # tp x dp = 4 TP ranks, 4 blocks, 2 passes each
    assert 0 < forms["dp"] < 2 * 4 * 1_361_024 / 10 / 50  # both replicas' payloads, far below a dense all-reduce


# -- the subspace codec on a BTP-sharded residual stream --------------------------------------------------------
def _sharded_subspace_worker(seed: int) -> dict:
    """Encode this rank's feature shard, decode back to it; loss = sum(W * X') over the shards (summed over TP)."""
    import torch.distributed as torch_dist

    from nanotron_ext.codecs.base import feature_shard
    from nanotron_ext.config.schema import ModelConfig
    from nanotron_ext.subspace.basis import SubspaceHub
    from nanotron_ext.subspace.codec import SubspaceDecoder, SubspaceEncoder

    torch_dist.init_process_group("gloo")
    pg = torch_dist.new_group(list(range(torch_dist.get_world_size())))
    cfg = ModelConfig(vocab_size=64, hidden_size=24, ffn_size=32, num_heads=2, num_kv_heads=2, num_layers=2,
                      tie_embeddings=False)
    cfg.subspace.k = 4
    hub = SubspaceHub(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hub.fixed.copy_(torch.randn(64, 24, generator=g))
    ids = torch.randint(0, 64, (2, 5), generator=g)
    residual, branch, weight = (torch.randn(2, 5, 24, generator=g) for _ in range(3))
    mine = feature_shard(pg, 24)
    res = residual[..., mine].clone().requires_grad_(True)
    br = branch[..., mine].clone().requires_grad_(True)
    wire = SubspaceEncoder(hub, torch.float32, pg)(residual=res, branch=br, input_ids=ids)
    x, _ = SubspaceDecoder(hub, 0, accumulate=False, sharded_pg=pg)(wire, ids)
    (weight[..., mine] * x).sum().backward()
    return {"wire": wire.detach(), "x": x.detach(), "d_res": res.grad, "d_branch": br.grad,
            "mine": (mine.start, mine.stop),
            "basis": hub.basis, "fixed": hub.fixed, "ids": ids, "residual": residual,
            "branch": branch, "weight": weight}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_subspace_codec_equals_the_unsharded_codec_in_float64(tp: int) -> None:
    """Z = sum over feature shards of (X - T_fixed[ids])_S U_S (one all-reduce of the k-wide Z), the decoder
    column-parallel (its backward all-reduces dZ): the wire, the rebuilt shard and the gradients of both
    inputs equal the unsharded codec's, computed here in float64 by autograd."""
    results = run_distributed(_sharded_subspace_worker, tp, 11)
    r0 = results[0]
    u, fixed, ids = r0["basis"].double(), r0["fixed"].double(), r0["ids"]
    residual = r0["residual"].double().requires_grad_(True)
    branch = r0["branch"].double().requires_grad_(True)
    z = (residual + branch - fixed[ids]) @ u
    x = z @ u.T + fixed[ids]
    (r0["weight"].double() * x).sum().backward()
    for r in results:
        lo, hi = r["mine"]
        assert torch.equal(r["wire"], r0["wire"])  # replicated over TP: the pipeline may send it once
        torch.testing.assert_close(r["wire"].double(), z.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["x"].double(), x.detach()[..., lo:hi], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["d_res"].double(), residual.grad[..., lo:hi], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["d_branch"].double(), branch.grad[..., lo:hi], rtol=1e-5, atol=1e-5)
