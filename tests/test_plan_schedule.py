"""Issue 41: `python -m nanotron_ext.plan --rank all` on a 4,096-rank layout started hundreds of processes at once
(load average 41 on 2 cores) and printed nothing for minutes. The planner now runs whole pipeline columns (a
column's stages size each other's receives) at most os.cpu_count() processes at a time, a column larger than that
alone, shows a progress bar over the columns, and plans each rank role (pp rank, replica config, TP rank) once,
giving its plan to the other ranks of the role under their own numbers. The processes here are stand-ins that count
the stand-ins running beside them (tests/helpers/fake_plan.py); test_plan.py holds the real plans to real runs."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.helpers import fake_plan
from tests.helpers.runs import TINY


def _plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, sets: List[str], ranks: List[int],
          expect: int) -> List[Dict[str, Any]]:
    """The planner over `sets`'s layout with stand-in workers on `cores` cores; each waits to see `expect` run."""
    import nanotron_ext.plan.run as run
    from nanotron_ext.config import load_config

    monkeypatch.setattr(run, "_worker", fake_plan.worker)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    (tmp_path / "running").mkdir()
    to_workers = [f"dir={tmp_path / 'running'}", f"expect={expect}"]  # what the stand-ins read of their overrides
    return run.plan_ranks(str(TINY), to_workers, load_config(TINY, sets), ranks)


LAYOUT = ["parallelism.dp=4", "parallelism.tp=2", "parallelism.pp=2", "model.tie_embeddings=false"]


def test_each_role_is_planned_once_and_given_to_every_rank_of_it(monkeypatch, tmp_path: Path, capsys) -> None:
    # dp 4 x tp 2 x pp 2, replicas alike: 4 roles (pp rank x TP rank), 16 ranks; 2 columns of 2 stages planned
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar shows on a terminal only
    plans = _plan(monkeypatch, tmp_path, 4, LAYOUT, list(range(16)), expect=4)
    assert [p["rank"] for p in plans] == list(range(16))
    assert [p["dp_rank"] for p in plans] == [r // 2 % 4 for r in range(16)]  # rank = (pp * dp + dp_rank) * tp + tp
    assert len({p["pid"] for p in plans}) == 4  # one process per role
    for r, p in enumerate(plans):  # the plan of (pp, replica 0, tp), each
        assert p["pid"] == plans[(r // 8 * 4) * 2 + r % 2]["pid"]
    assert "planning pipeline columns" in capsys.readouterr().err


@pytest.mark.parametrize("cores, most", [(3, 2), (4, 4)])
def test_columns_run_together_within_the_cores(monkeypatch, tmp_path: Path, cores: int, most: int) -> None:
    # 2 columns of 2 stages (ranks 0 and 2, 1 and 3): on 3 cores one column at a time, on 4 both
    plans = _plan(monkeypatch, tmp_path, cores, ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2",
                                                 "model.tie_embeddings=false"], [0, 1, 2, 3], expect=4)
    assert max(p["most"] for p in plans) == most
    for a, b in ((0, 2), (1, 3)):  # a column's stages run together
        assert b in plans[a]["beside"] or a in plans[b]["beside"], plans


def test_a_column_larger_than_the_cores_runs_alone(monkeypatch, tmp_path: Path) -> None:
    sets = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=4", "model.tie_embeddings=false",
            "tokens.batch_accumulation_per_replica=4"]
    plans = _plan(monkeypatch, tmp_path, 2, sets, list(range(8)), expect=4)
    assert max(p["most"] for p in plans) == 4  # the 4 stages of one column, never two columns
    assert {tuple(p["beside"]) for p in plans if p["most"] == 4} <= {(0, 2, 4, 6), (1, 3, 5, 7)}
