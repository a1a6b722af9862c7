"""A run read with `--checkpoints DIR` whose folder holds no checkpoint: the line names the flag that was given, not
the run config's checkpoints.dir (issue 53: an empty --checkpoints folder was blamed on the config's key)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nanotron_ext.inference.run import RunError, open_run

REPO = Path(__file__).resolve().parents[1]


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(REPO / "examples" / "config_tiny_llama.yaml", run / "config.yaml")
    return run


def test_an_empty_checkpoints_folder_is_blamed_on_the_flag(tmp_path: Path) -> None:
    run, empty = _run_folder(tmp_path), tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunError) as e:
        open_run(run, checkpoints=empty)
    line = str(e.value)
    assert line.startswith(f"no complete checkpoint in {empty} (--checkpoints {empty})"), line
    assert "checkpoints.dir" not in line, line


def test_without_the_flag_the_config_key_is_named(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    with pytest.raises(RunError, match=r"\(checkpoints.dir of .*config.yaml\)"):
        open_run(run, checkpoints=None)
