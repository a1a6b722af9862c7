"""Issue 41: `python -m nanotron_ext.plan --rank all` on a 4,096-rank layout started hundreds of processes at once
(load average 41 on 2 cores) and printed nothing for minutes. The planner now runs whole pipeline columns (a
column's stages size each other's receives) at most os.cpu_count() processes at a time, a column larger than that
alone, shows a progress bar over the columns, and plans each rank role (pp rank, replica config, TP rank) once,
giving its plan to the other ranks of the role under their own numbers. The processes here are stand-ins
(tests/helpers/fake_plan.py); test_plan.py holds the real plans to real runs."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest

from tests.helpers import fake_plan
from tests.helpers.runs import TINY


def _plan(monkeypatch: pytest.MonkeyPatch, cores: int, sets: List[str], ranks: List[int]) -> List[Dict[str, Any]]:
    import nanotron_ext.plan.run as run
    from nanotron_ext.config import load_config

    monkeypatch.setattr(run, "_worker", fake_plan.worker)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    return run.plan_ranks(str(TINY), sets, load_config(TINY, sets), ranks)


def _most_at_once(plans: List[Dict[str, Any]]) -> int:
    runs = {p["pid"]: (p["start"], p["end"]) for p in plans}
    edges: List[Tuple[float, int]] = sorted([(s, 1) for s, _ in runs.values()] + [(e, -1) for _, e in runs.values()])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


LAYOUT = ["parallelism.dp=4", "parallelism.tp=2", "parallelism.pp=2", "model.tie_embeddings=false"]


def test_each_role_is_planned_once_and_given_to_every_rank_of_it(monkeypatch, capsys) -> None:
    # dp 4 x tp 2 x pp 2, replicas alike: 4 roles (pp rank x TP rank), 16 ranks; 2 columns of 2 stages planned
    plans = _plan(monkeypatch, 4, LAYOUT, list(range(16)))
    assert [p["rank"] for p in plans] == list(range(16))
    assert [p["dp_rank"] for p in plans] == [r // 2 % 4 for r in range(16)]  # rank = (pp * dp + dp_rank) * tp + tp
    assert len({p["pid"] for p in plans}) == 4  # one process per role
    for r, p in enumerate(plans):  # the plan of (pp, replica 0, tp), each
        assert p["pid"] == plans[(r // 8 * 4) * 2 + r % 2]["pid"]
    assert "planning pipeline columns" in capsys.readouterr().err


@pytest.mark.parametrize("cores, most", [(3, 2), (4, 4)])
def test_columns_run_together_within_the_cores(monkeypatch, cores: int, most: int) -> None:
    # 2 columns of 2 stages: on 3 cores one column at a time, on 4 both
    plans = _plan(monkeypatch, cores, ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2",
                                       "model.tie_embeddings=false"], [0, 1, 2, 3])
    assert _most_at_once(plans) == most
    for col in ((0, 2), (1, 3)):  # a column's stages overlap: they run together
        a, b = (plans[r] for r in col)
        assert a["start"] < b["end"] and b["start"] < a["end"]


def test_a_column_larger_than_the_cores_runs_alone(monkeypatch) -> None:
    sets = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=4", "model.tie_embeddings=false",
            "tokens.batch_accumulation_per_replica=4"]
    plans = _plan(monkeypatch, 2, sets, list(range(8)))
    assert _most_at_once(plans) == 4  # the 4 stages of one column, never two columns
