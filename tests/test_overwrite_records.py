"""Issue 33 row 13: a checkpoints.resume=overwrite launch stopped before its first checkpoint cut the earlier run's
metrics.jsonl to its own steps (and replaced config.yaml), so the next launch resumed the earlier checkpoints with
two runs' records. The records now change owner together with the checkpoints (nanotron_ext/train/handover.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.jobs import run_job
from tests.test_trainer import TINY, _small_overrides

RECORDS = ("metrics.jsonl", "config.yaml", "summary.json", "loss.png")


def _crash_worker(overrides: list, at_step: int) -> int:
    """Train, failing inside step `at_step` (as a crash would: no summary, no checkpoint); returns the step reached."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    real = trainer.train_step

    def step() -> dict:
        if trainer.step + 1 == at_step:
            raise RuntimeError("injected crash")
        return real()

    trainer.train_step = step
    try:
        trainer.train()
    except RuntimeError as e:
        assert str(e) == "injected crash"
    return trainer.step


def _records(run_dir: Path) -> Dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in RECORDS}


def _checkpoints(ckpt: Path) -> Dict[str, bytes]:
    return {p.name: (p / "meta.json").read_bytes() for p in sorted(ckpt.iterdir()) if p.name.startswith("step_")}


@pytest.mark.slow
def test_an_overwrite_stopped_before_its_first_checkpoint_keeps_the_earlier_record(small_corpus: Path,
                                                                                   tmp_path: Path) -> None:
    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 3) + ["checkpoints.interval=1",
                                                                        "checkpoints.keep_last=3"]
    run_dir, ckpt = tmp_path / "tiny_llama", tmp_path / "ckpt"
    first = run_job(1, overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    records, checkpoints, names = _records(run_dir), _checkpoints(ckpt), sorted(p.name for p in run_dir.iterdir())
    assert [json.loads(line)["step"] for line in records["metrics.jsonl"].splitlines()] == [1, 2, 3]

    overwrite = overrides + ["checkpoints.resume=overwrite", "tokens.train_steps=5", "checkpoints.interval=100"]
    assert run_distributed(_crash_worker, 1, overwrite, 3) == [2]  # two steps trained, then a crash
    assert _records(run_dir) == records  # the earlier run's record, byte for byte
    assert _checkpoints(ckpt) == checkpoints

    again = run_job(1, overrides)  # a plain launch sees the earlier run, whole and alone
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run {run_dir} is complete (step 3 of 3, checkpoints in {ckpt}); nothing to do. Its stored results:" \
        in again.stdout, again.stdout[-3000:]
    assert _records(run_dir) == records and _checkpoints(ckpt) == checkpoints
    assert sorted(p.name for p in run_dir.iterdir()) == names  # nothing of the stopped launch is left

    # an overwrite that reaches its first checkpoint owns both: its checkpoint and its records, nothing earlier
    done = run_job(1, overrides + ["checkpoints.resume=overwrite", "tokens.train_steps=2", "checkpoints.interval=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(_checkpoints(ckpt)) == ["step_2"] and _checkpoints(ckpt)["step_2"] != checkpoints["step_2"]
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert "train_steps: 2" in (run_dir / "config.yaml").read_text()
    assert sorted(p.name for p in run_dir.iterdir()) == names


def _fake_checkpoint(ckpt: Path, step: int, tag: str) -> None:
    folder = ckpt / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step, "files": [], "tag": tag}))


@pytest.mark.parametrize("crash_at", range(10))  # every os.replace of a handover (9)
def test_a_handover_interrupted_anywhere_is_completed_by_the_next_launch(tmp_path: Path, crash_at: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from nanotron_ext.train import handover

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "config.yaml", "summary.json"):
        (run_dir / name).write_text(f"earlier {name}\n")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events").write_text("earlier events\n")
    _fake_checkpoint(ckpt, 2, "earlier")
    _fake_checkpoint(ckpt, 4, "earlier")
    staging = handover.begin(run_dir, ckpt)
    assert staging == run_dir / handover.STAGING
    for name in ("metrics.jsonl", "config.yaml"):
        (staging / name).write_text(f"new {name}\n")
    assert handover.recover(run_dir, ckpt) is not None and not staging.exists()  # no checkpoint yet: discarded
    assert (run_dir / "metrics.jsonl").read_text() == "earlier metrics.jsonl\n"

    staging = handover.begin(run_dir, ckpt)
    for name in ("metrics.jsonl", "config.yaml"):
        (staging / name).write_text(f"new {name}\n")
    _fake_checkpoint(ckpt, 1, "new")
    calls = {"n": 0}
    real = os.replace

    def crashing(src, dst):
        calls["n"] += 1
        if calls["n"] > crash_at:
            raise OSError(5, "injected crash")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crashing)
    try:
        handover.complete(run_dir, ckpt)
    except OSError:
        pass
    monkeypatch.setattr(os, "replace", real)
    handover.recover(run_dir, ckpt)  # the next launch
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert [(run_dir / n).read_text() for n in ("config.yaml", "metrics.jsonl")] == ["new config.yaml\n",
                                                                                   "new metrics.jsonl\n"]
