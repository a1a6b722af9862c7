"""The model clock's inputs and outputs (nanotron_ext/bench/clock/pricing.py, bench/wan/{model_results,modelled}.py): a
system's twin at a preset's scale, the planner's ledger priced per stage against hand formulas, bytes per step against
the closed forms, and time to target on the clock from curves and bounds written here."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from nanotron_ext.bench.clock import Link, pricing
from nanotron_ext.bench.wan import model_results, systems
from nanotron_ext.bench.wan.systems import run_overrides

SCALE = str(systems.REPO / "reproduce/het_sparseloco/sparseloco_512m.yaml")


def _args(**kw: object) -> argparse.Namespace:
    base = dict(config=systems.BASE, tp_preset="nvlink", steps=4, val_every=2, inner_steps=2, set=[])
    return argparse.Namespace(**{**base, **kw})


def test_the_twin_takes_the_presets_model_and_batch_and_scales_every_width() -> None:
    """three_tiers at d = 128 (k = 16 = d/8, SVD r = 32 = d/4) timed at the 512M config (d = 1536): k = 192, r = 384
    (the paper's own 87.5% setting is k = 192), its layout and techniques unchanged."""
    from nanotron_ext.config import load_config

    config = str(systems.system_config("three_tiers", _args()))
    sets = pricing.twin_overrides(config, run_overrides("three_tiers", None, 1, _args()), SCALE)
    cfg = load_config(config, sets)
    m, t, p = cfg.model, cfg.tokens, cfg.parallelism
    assert (m.hidden_size, m.ffn_size, m.num_layers, m.vocab_size) == (1536, 5440, 12, 32000)
    assert (t.sequence_length, t.micro_batch_size, t.batch_accumulation_per_replica) == (2048, 8, 4)
    assert (m.subspace.k, m.low_rank.rank) == (192, 384)
    assert (p.dp, p.tp, p.pp, p.dp_sync, m.tp_strategy) == (2, 2, 2, "sparseloco", "btp")
    assert not p.link.enabled
    assert pricing.twin_overrides(config, ["a=b"], None) == ["a=b", "parallelism.link.enabled=false"]


def _rank(flops: float, ledger: dict) -> dict:
    return {"flops": flops, "ledger": ledger}


def test_a_plan_is_priced_per_stage_by_hand() -> None:
    """Two stages, m = 4, tp = 2, dp = 2, the DP tier an outer loop: compute = FLOPs / m / throughput split 1:2,
    TP ring seconds per micro-batch half in each pass, the wire times tp, the outer sync = outer - inner step."""
    m, thr = 4, 1e12
    tp_ops = {"all_reduce": {"bytes": 4 * 1_000_000, "calls": 8}}
    inner = [[_rank(12e12, {"tp": tp_ops, "pp": {"send:fwd": {"bytes": 4 * 500, "calls": 4}}}),
              _rank(24e12, {"tp": tp_ops, "pp": {"send:bwd": {"bytes": 4 * 500, "calls": 4}},
                            "dp": {"all_reduce": {"bytes": 4, "calls": 1}}})]]
    outer = [[_rank(12e12, {"dp": {"all_gather": {"bytes": 10_000, "calls": 1}}}),
              _rank(24e12, {"dp": {"all_gather": {"bytes": 20_000, "calls": 1},
                                   "all_reduce": {"bytes": 4, "calls": 1}}})]]
    plan = {"layout": {"dp": 2, "tp": 2, "pp": 2}, "micro_batches": m, "schedule": "afab", "outer_every": 5,
            "replica_of": {"0": 0, "1": 0}, "inner": inner, "outer": outer}
    tp_link, dp_link = Link(8000.0, 0.01), Link(80.0, 10.0)
    works = pricing.replica_works(plan, {"tp": tp_link, "dp": dp_link}, [Link(8.0, 5.0), Link(800.0)], thr)
    assert len(works) == 2 and works[0].links == [Link(8.0, 5.0)] and works[1].links == [Link(800.0)]
    s0, s1 = works[0].stages
    # TP per micro-batch: 2 all-reduces of 500 kB on a ring of 2: 2 x (2 (1/2) 500e3 x 8 / 8e9 + 2 x 1e-5)
    tp_s = 2 * (500e3 * 8 / 8e9 + 2 * 1e-5)
    assert s0.fwd_s == pytest.approx(12e12 / m / thr / 3 + tp_s / 2)
    assert s1.bwd_s == pytest.approx(2 * 24e12 / m / thr / 3 + tp_s / 2)
    assert (s0.fwd_bytes, s0.bwd_bytes, s1.fwd_bytes, s1.bwd_bytes) == (2 * 500, 0, 0, 2 * 500)
    assert works[0].dp_s == [0.0, 0.0]  # a 4-byte agreement is control traffic: its ring's latency, no overlap
    assert works[0].control_s == pytest.approx([0.0, 2 * 1 * 0.01 + 4 * 8 / 80e6])
    # outer: an all-gather of N bytes on a ring of 2 = (p-1) N 8 / B + (p-1) lat, two TP rings on one uplink
    assert works[0].outer_s == pytest.approx([2 * 10_000 * 8 / 80e6 + 0.01, 2 * 20_000 * 8 / 80e6 + 0.01])
    per_step = pricing.bytes_per_step(plan)
    assert per_step["pp"] == 2 * 2 * (4 * 500 + 4 * 500)  # 2 replicas x 2 TP ranks x both directions
    assert per_step["dp"] == pytest.approx(2 * 2 * (10_000 + 20_000) / 5)


@pytest.mark.slow
def test_planned_bytes_of_the_real_layout_match_the_closed_forms(tmp_path: Path) -> None:
    """The uncompressed pipeline at the meter's scale: each micro-batch's activation b s d fp32 forward and its
    gradient back; DDP: every gradient (fp32) all-reduced by each of the 2 ranks (the tier closed forms)."""
    from nanotron_ext.config import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step

    for system in ("pipeline", "ddp"):
        config = str(systems.system_config(system, _args()))
        sets = pricing.twin_overrides(config, run_overrides(system, None, 1, _args()), None)
        plan = pricing.planned(config, sets, tmp_path / system)
        [cached] = (tmp_path / system).glob("plan_*.json")
        assert plan == pricing.planned(config, sets, tmp_path / system) and plan["outer_overlap"] == 0
        assert json.loads(cached.read_text()) == {k: v for k, v in plan.items() if k != "outer_overlap"}  # config's
        cfg = load_config(config, sets)
        t, d = cfg.tokens, cfg.model.hidden_size
        per_step = pricing.bytes_per_step(plan)
        assert per_step["pp"] == pytest.approx(job_bytes_per_step(cfg).get("pp") or 0.0)
        assert per_step["dp"] == pytest.approx(job_bytes_per_step(cfg).get("dp") or 0.0)
        if system == "pipeline":
            works = pricing.replica_works(plan, {"tp": Link(0.0), "dp": Link(0.0)}, [Link(0.0)], 1e9)
            assert works[0].stages[0].fwd_bytes == t.micro_batch_size * t.sequence_length * d * 4
            assert per_step["pp"] == 2 * t.batch_accumulation_per_replica * t.micro_batch_size * t.sequence_length \
                * d * 4


def _curve(losses: list) -> list:
    return [[10 * (i + 1), x] for i, x in enumerate(losses)]


def test_time_to_target_is_steps_to_target_times_the_clocks_step() -> None:
    curves = [{"system": "dense_3d", "seed": s, "val_curve": _curve([5.0, 4.0, 3.0]), "final_val_loss": 3.0}
              for s in (1, 2)]
    curves += [{"system": "three_tiers", "seed": 1, "val_curve": _curve([4.5, 3.05, 2.9]), "final_val_loss": 2.9},
               {"system": "three_tiers", "seed": 2, "val_curve": _curve([4.5, 3.5, 3.2]), "final_val_loss": 3.2},
               {"system": "3d_sm", "seed": 1, "val_curve": _curve([4.0, 3.0, 2.9]), "final_val_loss": 2.9}]
    clock = lambda lo, hi: {"lower_s": lo, "upper_s": hi, "bytes_per_step": {}, "tokens_per_step": 100}  # noqa
    clocks = {("p", "dense_3d"): clock(10.0, 12.0), ("p", "three_tiers"): clock(1.0, 2.0),
              ("p", "3d_sm"): clock(5.0, 5.0)}
    rows = {r["system"]: r for r in model_results.pooled_rows(curves, clocks, "dense_3d", 0.02)}
    assert rows["dense_3d"]["target_val_loss"] == pytest.approx(3.06)
    assert rows["dense_3d"]["time_to_target_s"]["lower"][0] == pytest.approx(30 * 10.0)
    assert rows["three_tiers"]["reached"] == "1/2"
    assert rows["three_tiers"]["time_to_target_s"] == {"lower": (20.0, None), "upper": (40.0, None)}
    assert rows["three_tiers"]["tokens_per_s"]["lower"] == 100.0
    # at dense 3D's 300 s (full overlap) three tiers has done 300 steps: its final loss; 3d_sm 60 steps: 2.9
    assert rows["three_tiers"]["val_loss_at_reference_time"]["lower"][0] == pytest.approx((2.9 + 3.2) / 2)
    lines = model_results.headline(list(rows.values()))
    assert lines[0].startswith("p, equal tokens (full overlap): best composed three_tiers 0.01 h (1/2)")
    assert "dense 3D 0.08 h: 15.00x (goal >= 3x: met)" in lines[0]
    assert "best single-tier (3d_sm) 0.03 h: 5.00x" in lines[0] and "dense DiLoCo: not reached" in lines[0]
    assert lines[-1] == ("p, equal tokens, looser target 3.050 (the best composed system's final loss, three_tiers), "
                         "full overlap: three_tiers 0.01 h, 3d_sm 0.03 h, dense_3d 0.08 h")
    headers, body = model_results.table(list(rows.values()))
    assert len(body) == 3 and len(headers) == len(body[0])


@pytest.mark.slow
def test_the_meter_on_the_model_clock_end_to_end(tmp_path: Path, small_corpus: Path, monkeypatch) -> None:
    """Two systems, 4 steps, one seed, a preset that times them at the size they train (no scale config): the
    result's rows, curves and clocks; an equal-time run of SparseLoCo sized from the pipeline's time to target;
    the saved result re-rendered."""
    from nanotron_ext.bench.clock import ClockPreset
    from nanotron_ext.bench.wan import cli
    from tests.conftest import SMALL_VOCAB

    preset = ClockPreset("test", "", "CPU", 0.001, (1e4, 0.1), (100.0, 5.0), (1e4, 0.01), (100.0, 5.0))
    monkeypatch.setattr("nanotron_ext.bench.wan.modelled.CLOCK_PRESETS", {"test": preset})
    corpus = [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
              f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]
    out = tmp_path / "model.json"
    argv = ["--clock", "model", "--clock-preset", "test", "--systems", "pipeline", "sparseloco", "--reference",
            "pipeline", "--steps", "4", "--val-every", "2", "--inner-steps", "2", "--seeds", "1", "--jobs", "2",
            "--equal-time", "sparseloco", "--max-steps", "6", "--runs", str(tmp_path / "runs"), "--out", str(out),
            *[x for c in corpus for x in ("--set", c)]]
    monkeypatch.setattr("nanotron_ext.bench.wan.cli.CLOCK_PRESETS", {"test": preset})
    assert cli.main(argv) == 0
    saved = json.loads(out.read_text())
    rows = {(r.get("budget", "tokens"), r["system"]): r for r in saved["rows"]}
    pipe, loco = rows[("tokens", "pipeline")], rows[("tokens", "sparseloco")]
    assert pipe["reached"] == "1/1"  # its own final loss is within its own target
    assert pipe["step_s"]["lower"] <= pipe["step_s"]["upper"]
    assert pipe["bytes_per_step"]["pp"] > 0 and loco["bytes_per_step"]["dp"] > 0
    timed = rows[("time", "sparseloco")]
    steps = min(6, int(timed["budget_s"] / loco["step_s"]["lower"]))
    assert timed["budget_steps"] == steps - steps % 2 and timed["target_val_loss"] == pipe["target_val_loss"]
    assert saved["meta"]["clock"] == "model" and len(saved["runs"]) == 3
    again = tmp_path / "again.json"
    assert cli.main(["--from-json", str(out), "--out", str(again)]) == 0
    assert json.loads(again.read_text())["rows"] == saved["rows"]
