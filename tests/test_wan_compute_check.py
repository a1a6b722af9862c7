"""Issue 45, item 4: every emulated run checks that its link / compute ratio is the preset's. A run's compute is its
ranks' CPU seconds; the model clock replays the run over free links (compute C) and over its own links ([L, U]).
Here the clock's numbers are held to the closed form of a two-stage GPipe step with one micro-batch, and a run
stretched by load is flagged where one at the clock's step is not."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanotron_ext.bench.clock import compute_check

FLOPS, FWD_BYTES, BWD_BYTES = 3e9, 1_000_000, 500_000
MBPS, LATENCY_MS = 80.0, 20.0


def _plan() -> dict:
    """pp = 2, one micro-batch, each stage FLOPS per step, one activation forward and one gradient back."""
    def stage(direction: str, nbytes: int) -> dict:
        return {"flops": FLOPS, "ledger": {"pp": {f"send:{direction}": {"bytes": nbytes, "calls": 1}}}}
    return {"layout": {"dp": 1, "tp": 1, "pp": 2}, "micro_batches": 1, "schedule": "afab", "replica_of": {"0": 0},
            "inner": [[stage("fwd", FWD_BYTES), stage("bwd", BWD_BYTES)]], "outer": [], "outer_every": 0}


def _link(mbps: float = MBPS, latency_ms: float = LATENCY_MS) -> SimpleNamespace:
    tier = SimpleNamespace(bandwidth_mbps=0.0, latency_ms=0.0, duplex="full")
    return SimpleNamespace(per_stage_pair={}, bandwidth_mbps=mbps, latency_ms=latency_ms, duplex="full", tp=tier,
                           dp=tier)


def _message_s(nbytes: int) -> float:
    return nbytes * 8 / (MBPS * 1e6) + LATENCY_MS / 1e3


def test_the_clock_of_a_two_stage_step_is_its_closed_form() -> None:
    # each stage's CPU second is its compute: 1 s per stage, stages in series with one micro-batch (GPipe), the
    # activation and the gradient crossing once each: no overlap is possible, both bounds are the sum
    cpu = [1.0, 1.0]
    step = sum(cpu) + _message_s(FWD_BYTES) + _message_s(BWD_BYTES)
    got = compute_check.check(_plan(), _link(), cpu, step)
    assert got["compute_step_s"] == pytest.approx(2.0)
    assert got["clock_step_s"] == pytest.approx([step, step])
    assert got["clock_link_over_compute"] == pytest.approx([(step - 2.0) / 2.0] * 2)
    assert got["compute_stretch"] == pytest.approx([1.0, 1.0], rel=1e-6) and got["ratio_flag"] is False


def test_a_run_whose_compute_was_stretched_by_load_is_flagged() -> None:
    # the same links, but the run's step is what 4 processes per core make of 1 s of compute each: its link /
    # compute ratio reads 4x smaller than the preset's, and the check says so
    cpu = [1.0, 1.0]
    links_s = _message_s(FWD_BYTES) + _message_s(BWD_BYTES)
    stretched = compute_check.check(_plan(), _link(), cpu, 4 * sum(cpu) + links_s)
    assert stretched["compute_stretch"] == pytest.approx([4.0, 4.0], rel=1e-6) and stretched["ratio_flag"] is True
    within = compute_check.check(_plan(), _link(), cpu, 1.1 * sum(cpu) + links_s)  # 10% slower: not flagged
    assert within["compute_stretch"] == pytest.approx([1.1, 1.1], rel=1e-6) and within["ratio_flag"] is False
    faster = compute_check.check(_plan(), _link(), cpu, 0.5 * sum(cpu) + links_s)  # CPU seconds overstated 2x
    assert faster["ratio_flag"] is True


def test_stage_pairs_with_their_own_links_and_runs_without_cpu_seconds_are_not_checked() -> None:
    link = _link()
    link.per_stage_pair = {"0-1": {"latency_ms": 5.0}}
    assert "not checked" in compute_check.check(_plan(), link, [1.0, 1.0], 3.0)["compute_check"]
    assert "not checked" in compute_check.check(_plan(), _link(), [], 3.0)["compute_check"]


def test_the_note_names_the_flagged_runs() -> None:
    ok = {"system": "pipeline", "seed": 1, "compute_check": {"ratio_flag": False, "compute_stretch": [0.9, 1.1]}}
    bad = {"system": "dense_3d", "seed": 2, "compute_check": {"ratio_flag": True, "compute_stretch": [3.5, 4.2]}}
    old = {"system": "ddp", "seed": 1, "compute_check": {"compute_check": "not checked (...)"}}
    line = compute_check.note([ok, bad, old])
    assert "1 of 2 runs within" in line and "dense_3d seed 2 (compute 3.50-4.20x its CPU seconds)" in line
    assert "1 not checked" in line and "pipeline" not in line
