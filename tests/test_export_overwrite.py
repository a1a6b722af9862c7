"""Issue 33 rows 1, 2 and 4 (export): `--overwrite` replaces only a folder that export itself wrote, never a run's
checkpoint or record folder; `--out` that is a file is one line; an export is replaced in one atomic swap, so a
crash while it is put in place leaves the earlier export whole."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers.runs import REPO, train_tiny_run

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("export_guard"))


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run this test may lose (its checkpoints are passed with --checkpoints)."""
    shutil.copytree(trained, tmp_path / "out")
    return tmp_path / "out"


def _files(folder: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _export(run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nanotron_ext.export", "--run", str(run / "run"), "--checkpoints", str(run / "ckpt"),
           "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def _refused(run: Path, out: Path, *extra: str) -> List[str]:
    before = {p: _files(p) for p in (run / "run", run / "ckpt", out) if p.is_dir()}
    got = _export(run, out, *extra)
    assert got.returncode == 2, (got.returncode, got.stderr[-3000:])
    assert {p: _files(p) for p in before} == before  # nothing deleted or changed
    return got.stderr.splitlines()


@pytest.mark.parametrize("where", ["ckpt", "run"])
def test_overwrite_refuses_the_runs_checkpoint_and_record_folders(run: Path, where: str) -> None:
    # rows 1 and 2: --out <checkpoints.dir> --overwrite deleted every checkpoint; --out <the run folder> its
    # metrics.jsonl, config.yaml, summary and plot
    out = run / where
    lines = _refused(run, out, "--overwrite")
    assert lines == [f"error: --out {out} is not an earlier export (it has no nanotron_ext_export.json): --overwrite "
                     "replaces only a folder that export wrote; nothing was deleted, choose another folder"]
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_1", "step_2"]


def test_out_that_is_a_file_is_one_line(run: Path) -> None:
    # row 4: a NotADirectoryError traceback
    out = run / "run" / "metrics.jsonl"
    assert _refused(run, out, "--overwrite") == [f"error: --out {out} is a file; give the path of a folder to write"]


def test_overwrite_replaces_an_earlier_export_but_not_what_a_user_added(run: Path) -> None:
    out = run / "hf"
    first = _export(run, out)
    assert first.returncode == 0, first.stderr[-3000:]
    written = json.loads((out / "nanotron_ext_export.json").read_text())["files"]
    assert sorted(p.name for p in out.iterdir()) == written and "model.safetensors" in written
    assert _refused(run, out) == [f"error: --out {out} exists and is not empty; choose another folder or pass "
                                  "--overwrite (it replaces only an earlier export)"]
    (out / "notes.txt").write_text("mine\n")
    assert _refused(run, out, "--overwrite") == [
        f"error: --out {out} is not an earlier export (export did not write notes.txt): --overwrite replaces only a "
        "folder that export wrote; nothing was deleted, choose another folder"]
    (out / "notes.txt").unlink()
    again = _export(run, out, "--overwrite", "--step", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "nanotron_ext_export.json").read_text())["step"] == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["ckpt", "hf", "run"]  # no temporary folder left


def test_a_crash_while_the_new_export_is_put_in_place_keeps_the_old_one(run: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the old export was renamed away, then the new one renamed in: a crash between the two left no export at --out
    from nanotron_ext.export import main

    out = run / "hf"
    assert main(["--run", str(run / "run"), "--checkpoints", str(run / "ckpt"), "--out", str(out)]) == 0
    before = _files(out)
    real = {name: getattr(os, name) for name in ("replace", "rename")}

    def crash_placing_out(name: str):
        def call(src, dst, *a, **kw):
            if Path(dst) == out:
                raise OSError(5, "injected crash", str(dst))
            return real[name](src, dst, *a, **kw)
        return call

    for name in real:
        monkeypatch.setattr(os, name, crash_placing_out(name))
    try:
        main(["--run", str(run / "run"), "--checkpoints", str(run / "ckpt"), "--out", str(out), "--overwrite",
              "--step", "1"])
    except OSError:
        pass
    assert out.is_dir(), "no export left at --out"
    after = _files(out)
    info = json.loads(after["nanotron_ext_export.json"])
    assert after == before or (info["step"] == 1 and sorted(after) == info["files"])  # the old one or the new one
