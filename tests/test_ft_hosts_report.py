"""python -m nanotron_ext.sparseloco.ft_hosts's report (issue 52 item 4) on hand-written run folders: the inner and
sync steps are told apart by H, a sync's extra bytes are its step's less an inner step's, the stage wire is the
pipeline's two send directions, and an oversubscribed run says its timing is not a result."""
from __future__ import annotations

import json
from pathlib import Path

from nanotron_ext.sparseloco.ft_hosts import render, replica_row


def _run(tmp_path: Path) -> Path:
    inner = {"tp": 100, "pp": 70, "pp:send:fwd": 30, "pp:send:bwd": 30}
    sync = {"tp": 150, "pp": 90, "ft": 40, "pp:send:fwd": 30, "pp:send:bwd": 30}
    rows = [{"step": s, "loss": 9.0 - s, "step_time_s": 0.5 if s % 2 else 0.8, "comm_bytes": sync if s % 2 == 0
             else inner} for s in range(1, 7)]
    rows[0]["step_time_s"] = 5.0  # the first step (warm-up) is left out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"final_val_loss": 2.5}))
    return tmp_path


def test_replica_row_splits_inner_and_sync_steps(tmp_path: Path) -> None:
    row = replica_row(_run(tmp_path), 2, {"tp": 80.0, "pp": 60.0})
    assert row["losses"] == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0] and row["final_val_loss"] == 2.5
    assert row["inner_step_s"] == 0.5 and row["sync_step_s"] == 0.8
    assert row["ledger_inner_step_bytes"] == {"tp": 100, "pp": 70, "pp_wire": 60}
    assert row["ledger_sync_extra_bytes"] == {"tp": 50, "pp": 20, "ft": 40}


def test_render_says_an_oversubscribed_timing_is_not_a_result(tmp_path: Path) -> None:
    row = replica_row(_run(tmp_path), 2, {"tp": 80.0, "pp": 60.0})
    clock = {"compute_step_s": 0.2, "clock_step_s": {"full_overlap": 0.25, "no_overlap": 0.3},
             "clock_tbf_step_s": {"full_overlap": 0.2, "no_overlap": 0.22}}
    result = {"replicas": {"0": row, "1": {**row, "clock": clock}}, "rate_mbps": 20.0, "steps": 6, "inner_steps": 2,
              "processes": 8, "cores": 2, "meta": {"date": "d", "command": "c", "loadavg_1m": 1.0}}
    text = render(result)
    assert "| 1 | 8.0000 / 3.0000 | 2.5000 | 0.500 | 0.800 | 100 / 80 | 60 / 60 | 40 / 50 / 20 | 0 |" in text
    assert "0.250 / 0.300 s" in text and "needs at least as many cores as processes" in text
    assert "oversubscription" not in render({**result, "cores": 8})
