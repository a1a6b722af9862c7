"""Issue 41, a trained run: a run whose worker was killed after summary.json was written had no loss.png, which the
relaunch never drew."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.helpers.runs import corpus_overrides, prepare_corpus, run_overrides, train_worker, write_corpus

pytestmark = pytest.mark.slow  # a trained run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """A 2-step run on one process with a checkpoint per step (keep_last 2: step_1 and step_2)."""
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("live")
    write_corpus(root / "corpus.jsonl")
    base = corpus_overrides(root / "corpus.jsonl", root / "prepared")
    prepare_corpus(base)
    sets = run_overrides(base, root / "out", 1, 1) + ["checkpoints.interval=1", "checkpoints.keep_last=2"]
    run_distributed(train_worker, 1, sets)
    return {"root": root, "sets": sets}


def _copy(trained: Dict[str, Any], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(trained["root"] / "out", out)
    return out


def test_the_relaunch_of_a_run_killed_after_its_summary_draws_the_missing_plot(trained, tmp_path: Path) -> None:
    # a worker killed between summary.json and loss.png: the relaunch said the run was complete, no plot ever
    import subprocess

    from tests.helpers.jobs import job_cmd
    from tests.helpers.runs import REPO

    out = _copy(trained, tmp_path)
    sets = [s.replace(str(trained["root"] / "out"), str(out)) for s in trained["sets"]]
    plot, summary = out / "run" / "loss.png", out / "run" / "summary.json"
    plot.unlink()
    before = summary.read_bytes()
    proc = subprocess.run(job_cmd(1, sets), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert plot.exists() and summary.read_bytes() == before
    assert f"{plot} was missing and is drawn again from metrics.jsonl" in proc.stdout, proc.stdout[-2000:]
    assert "is complete" in proc.stdout
