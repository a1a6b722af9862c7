"""The clock validation's verdicts (nanotron_ext/bench/wan/validate.py): each measured step is held to the one bound
its trainer achieves, by hand-computed numbers, and the overlap achieved is (upper - measured) / (upper - lower)."""
from __future__ import annotations

import pytest

from nanotron_ext.bench.wan.validate import judge, notes, table, trainer_bound


def _plan(pp: int = 1, overlap: int = 0) -> dict:
    return {"layout": {"dp": 2, "tp": 1, "pp": pp}, "outer_overlap": overlap}


def test_each_trainer_is_held_to_its_own_bound() -> None:
    assert trainer_bound(_plan()) == "upper" and trainer_bound(_plan(overlap=2)) == "lower"
    assert trainer_bound(_plan(pp=2)) == ""
    blocking = judge(0.272, 0.158, 0.268, _plan())
    assert blocking["off_trainer_bound"] == pytest.approx(0.272 / 0.268 - 1) and blocking["held_trainer_bound"]
    assert blocking["overlap_achieved"] == pytest.approx((0.268 - 0.272) / 0.11)
    streaming = judge(0.20, 0.16, 0.27, _plan(overlap=4))  # 25% above the tau bound: inside the old window, not here
    assert streaming["off_trainer_bound"] == pytest.approx(0.25) and streaming["held_trainer_bound"] is False
    assert streaming["overlap_achieved"] == pytest.approx(0.07 / 0.11)
    # one job's per-step agreement queues behind the sync on the DP link: held to upper, full overlap beside
    agreed = judge(0.26, 0.16, 0.27, _plan(overlap=4), agreements_s=0.03)
    assert agreed["trainer_bound"] == "upper" and trainer_bound(_plan(overlap=4), 0.03) == "upper"
    assert agreed["off_trainer_bound"] == pytest.approx(0.26 / 0.27 - 1) and agreed["held_trainer_bound"]
    assert agreed["off_lower"] == pytest.approx(0.26 / 0.16 - 1)
    pipe = judge(0.44, 0.35, 0.68, _plan(pp=2))
    assert pipe["held_trainer_bound"] is None and pipe["off_trainer_bound"] is None


def test_the_table_and_notes_say_which_bound_and_count_only_judged_rows() -> None:
    base = {"preset": "p", "processes": 2, "compute_step_s": 0.16, "clock_lower_s": 0.16, "clock_upper_s": 0.27,
            "held": True, "link_over_compute": 0.5, "clock_link_over_compute": [0.0, 0.7], "ratio_flag": False,
            "loadavg_1m": {"free": 1.0, "emulated": 1.1}}
    rows = [{**base, "system": "s", "measured_step_s": 0.17, **judge(0.17, 0.16, 0.27, _plan(overlap=4))},
            {**base, "system": "p", "measured_step_s": 0.2, **judge(0.2, 0.16, 0.27, _plan(pp=2))}]
    headers, body = table(rows)
    col = headers.index("trainer's bound")
    assert body[0][col] == "lower (tau 4)" and body[1][col] == "none (between)"
    queued = {**base, "system": "q", "measured_step_s": 0.26, **judge(0.26, 0.16, 0.27, _plan(overlap=4), 0.03)}
    assert table([queued])[1][0][col] == "upper (tau 4, agreements queue behind the sync)"
    assert body[0][col + 1] == "1.06" and body[1][col + 1] == "-"
    assert any(line.startswith("1 of 1 within 15% of the one bound") for line in notes(rows))
