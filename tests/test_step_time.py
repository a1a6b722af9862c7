"""`python -m nanotron_ext.bench.step_time` (a config's step time on named hardware): the clock's terms on plans
written here by hand against closed forms (one stage: FLOPs / throughput; two stages under AFAB over a link: GPipe's
bubble plus the link), the command's one-line errors, its report read from a seeded plan cache, and the papers'
presets against the throughputs reproduce/results/PAPER_SCALE.json fitted."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from nanotron_ext.bench import step_time
from nanotron_ext.bench.clock import HARDWARE, NONE, ClockPreset, all_presets

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "config_tiny_llama.yaml")


def _rank(flops: float, ledger: Dict[str, Any]) -> Dict[str, Any]:
    return {"flops": flops, "ledger": ledger}


def _plan(ranks: List[Dict[str, Any]], m: int, schedule: str = "afab") -> Dict[str, Any]:
    """A plan in bench/clock/pricing.planned's form: one replica, TP 1, the given stages."""
    return {"layout": {"dp": 1, "tp": 1, "pp": len(ranks)}, "micro_batches": m, "schedule": schedule,
            "outer_every": 0, "replica_of": {"0": 0}, "inner": [ranks], "outer": None, "tokens_per_step": 1000}


def _preset(stage: tuple = NONE, duplex: str = "full") -> ClockPreset:
    return ClockPreset("test", "", "test device", 1.0, NONE, stage, NONE, NONE, (), duplex)


def test_one_stage_without_links_takes_its_flops_at_the_throughput() -> None:
    terms = step_time.clock_terms(_plan([_rank(3e12, {})], m=4), _preset(), tflops=2.0)
    assert terms["lower_s"] == pytest.approx(1.5) and terms["upper_s"] == pytest.approx(1.5)
    assert terms["compute_s"] == pytest.approx(1.5) and terms["bubble_s"] == pytest.approx(0.0)
    assert terms["stage_link_s"] == [0.0, 0.0] and terms["stage_wire_s"] == 0.0


def test_two_stages_afab_over_a_link_take_gpipes_bubble_plus_the_link() -> None:
    """Each stage computes F per step over m micro-batches: f = F / 3m, b = 2F / 3m per micro-batch (the clock's 1:2
    split). A message of t <= f, b seconds each way, no latency. Overlapped (a send does not stop its sender) the
    forwards reach stage 1 t late and the gradients reach stage 0 t late: (m + 1)(f + b) + 2t, GPipe's
    (m + p - 1)(f + b) at p = 2 plus the link twice. Blocking, every message holds its sender t, spacing the
    forwards f + t and the gradients b + t apart: (m + 1)(f + b) + 2 m t."""
    m, flops, tflops = 4, 12e12, 1.0  # f = 1 s, b = 2 s
    nbytes = 0.5e6  # 0.5 MB at 8 Mbit/s: t = 0.5 s
    ranks = [_rank(flops, {"pp": {"send:fwd": {"bytes": m * nbytes, "calls": m}}}),
             _rank(flops, {"pp": {"send:bwd": {"bytes": m * nbytes, "calls": m}}})]
    f, b, t = 1.0, 2.0, 0.5
    terms = step_time.clock_terms(_plan(ranks, m), _preset((8.0, 0.0)), tflops)
    assert terms["compute_s"] == pytest.approx(m * (f + b))
    assert terms["bubble_s"] == pytest.approx(f + b)  # (p - 1)(f + b)
    assert terms["lower_s"] == pytest.approx((m + 1) * (f + b) + 2 * t)
    assert terms["upper_s"] == pytest.approx((m + 1) * (f + b) + 2 * m * t)
    assert terms["stage_link_s"] == pytest.approx([2 * t, 2 * m * t])
    assert terms["stage_wire_s"] == pytest.approx(m * t)  # full duplex: the busier direction
    half = step_time.clock_terms(_plan(ranks, m), _preset((8.0, 0.0), "half"), tflops)
    assert half["stage_wire_s"] == pytest.approx(2 * m * t)  # one wire carries both directions


def _exit_code(argv: list) -> object:
    """main's exit code: what it returns, or the SystemExit of a flag refused while the arguments are parsed."""
    try:
        return step_time.main(argv)
    except SystemExit as e:
        return e.code


def test_an_unknown_preset_is_one_line_naming_it_and_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    assert _exit_code(["--config-file", TINY, "--preset", "a10g-typo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'a10g-typo'" in err[0]
    assert all(name in err[0] for name in all_presets())


@pytest.mark.parametrize("tflops", ["0", "-3", "nan"])
def test_a_throughput_that_is_not_positive_is_one_line(tflops: str, capsys: pytest.CaptureFixture) -> None:
    assert _exit_code(["--config-file", TINY, "--preset", "resbm-a10g-80m", "--tflops", tflops]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tflops")


def test_the_report_reads_a_cached_plan_and_prints_bounds_tokens_and_breakdown(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The tiny config's plan seeded in the cache under its key (nothing planned): one stage of 6e12 FLOPs at the
    preset's 18.6 TFLOP/s is 6 / 18.6 s per step, whatever the tiny config's layout would plan."""
    from nanotron_ext.bench.clock import plan_path
    from nanotron_ext.config.loader import load_config

    cfg = load_config(TINY, [])
    plan = _plan([_rank(6e12, {})], m=cfg.tokens.batch_accumulation_per_replica)
    del plan["tokens_per_step"]
    dp = cfg.parallelism.dp  # the cache refuses a plan of another layout than its config's (plan/cached.py)
    plan.update(layout={**plan["layout"], "dp": dp}, replica_of={str(r): 0 for r in range(dp)})
    plan_path(cfg, tmp_path).write_text(json.dumps(plan))
    out_json = tmp_path / "t.json"
    assert step_time.main(["--config-file", TINY, "--preset", "resbm-a10g-80m", "--plans", str(tmp_path),
                           "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    step = 6 / HARDWARE["resbm-a10g-80m"].tflops
    t = cfg.tokens
    tokens = t.sequence_length * t.micro_batch_size * t.batch_accumulation_per_replica * cfg.parallelism.dp
    assert f"{step:.4g} s (full overlap)" in out and f"tokens/s {tokens / step:,.0f}" in out
    assert "80 Mbit/s, 0 ms one way, half duplex" in out and "ResBM (arXiv:2604.11947)" in out
    assert "compute (slowest stage)" in out and "+ stage links" in out
    saved = json.loads(out_json.read_text())
    assert saved["lower_s"] == pytest.approx(step) and saved["tokens_per_step"] == tokens


def test_every_paper_preset_holds_the_throughput_paper_scale_fitted() -> None:
    """reproduce/paper_scale.py fits each paper's device throughput on one row; the presets carry that fit (or,
    where the row cannot fit one, the stated assumption the table used)."""
    fits = json.loads((REPO / "reproduce" / "results" / "PAPER_SCALE.json").read_text())["fits"]
    for fit in fits.values():
        assert HARDWARE[fit["preset"]].tflops == pytest.approx(fit["tflops"], rel=0.01), fit["preset"]
        siblings = [p for p in HARDWARE.values() if p.source == HARDWARE[fit["preset"]].source]
        assert {p.tflops for p in siblings} == {HARDWARE[fit["preset"]].tflops}
    assert all(p.source and p.device for p in HARDWARE.values())


def test_a_preset_stage_override_keeps_the_rest() -> None:
    """The table's bandwidth sweeps replace only the stage link (dataclasses.replace on a frozen preset)."""
    p = dataclasses.replace(HARDWARE["resbm-a10g-80m"], stage=(800.0, 0.0))
    assert p.stage == (800.0, 0.0) and p.duplex == "half" and p.tflops == HARDWARE["resbm-a10g-80m"].tflops


def test_json_never_replaces_a_file_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}\n')
    assert _exit_code(["--config-file", TINY, "--preset", "resbm-a10g-80m", "--json", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --json") and mine.read_text() == '{"mine": 1}\n'


def test_steady_state_has_no_bubble_and_an_update_is_priced_once_per_step() -> None:
    """Two stages of 6e12 FLOPs a step at 1 TFLOP/s, 3e12 of them a once-per-step update (Muon's Newton-Schulz: the
    plan less its AdamW twin), 4 micro-batches over free links: each micro-batch 0.75 s. A flushed AFAB step is
    (m + p - 1) 0.75 + 3 = 6.75 s (its bubble one micro-batch, 0.75 s); the steady state m 0.75 + 3 = 6 s, no bubble.
    Spread over the micro-batches instead, the update would be charged in the bubble too: 5 x 1.5 = 7.5 s."""
    ranks = [{**_rank(6e12, {}), "update_flops": 3e12} for _ in range(2)]
    flushed = step_time.clock_terms(_plan(ranks, m=4), _preset(), 1.0)
    assert flushed["lower_s"] == pytest.approx(6.75) and flushed["bubble_s"] == pytest.approx(0.75)
    assert flushed["update_s"] == pytest.approx(3.0) and flushed["compute_s"] == pytest.approx(6.0)
    steady = step_time.clock_terms(_plan(ranks, m=4), _preset(), 1.0, steady=True)
    assert steady["lower_s"] == pytest.approx(6.0) and steady["bubble_s"] == pytest.approx(0.0)
    spread = step_time.clock_terms(_plan([_rank(6e12, {})] * 2, m=4), _preset(), 1.0)
    assert spread["lower_s"] == pytest.approx(7.5)
    faster = dataclasses.replace(_preset(), update_tflops=3.0)  # a stated rate for the update: 1 s
    assert step_time.clock_terms(_plan(ranks, m=4), faster, 1.0)["lower_s"] == pytest.approx(4.75)
