"""Issue 33's hurried-user pass (export, eval, generate, data, the training launcher): each value below used to be
accepted and then lose a file, hang, or end in a traceback or wrong advice; now it is one line naming the flag or
key and the file or value, exit code 2, before any work. A FIFO stands in for /dev/zero where the old code read
until the kernel killed it (a FIFO without a writer blocks instead: the old code timed out, nothing else)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from tests.helpers.runs import REPO, TINY, train_tiny_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("hurried"))


def _cli(module: str, args: List[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line(got: subprocess.CompletedProcess) -> str:
    assert got.returncode == 2, (got.returncode, got.stdout[-1000:], got.stderr[-3000:])
    return got.stderr.splitlines()[0]


def _run_args(trained: Path) -> List[str]:
    return ["--run", str(trained / "run"), "--checkpoints", str(trained / "ckpt")]


def _eval(trained: Path, *args: str) -> subprocess.CompletedProcess:
    return _cli("nanotron_ext.eval", _run_args(trained) + ["--data", str(trained.parent / "corpus.jsonl"), *args],
                timeout=120)


@pytest.mark.slow
def test_eval_json_never_replaces_a_runs_record(trained: Path, tmp_path: Path) -> None:
    # the run's summary.json was replaced by the scores
    summary = trained / "run" / "summary.json"
    before = summary.read_bytes()
    assert _one_line(_eval(trained, "--json", str(summary))) == (
        f"error: --json {summary} exists and is not an earlier result of python -m nanotron_ext.eval (a JSON object "
        "with run, step, data, loss, perplexity, bits_per_byte); nothing was written: choose another file")
    assert summary.read_bytes() == before
    fifo = tmp_path / "scores.json"
    os.mkfifo(fifo)  # as /dev/null: the atomic write put a regular file in its place
    assert _one_line(_eval(trained, "--json", str(fifo))) == (
        f"error: --json {fifo} is not a regular file (a device or a pipe?); give the path of a file to write")
    assert fifo.is_fifo()
    scores = tmp_path / "ok.json"
    for _ in range(2):  # an earlier result of eval is replaced
        got = _eval(trained, "--json", str(scores))
        assert got.returncode == 0, got.stderr[-2000:]


@pytest.mark.slow
def test_eval_data_that_is_a_pipe_is_refused_before_reading(trained: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    assert _one_line(_eval(trained, "--data", str(fifo))) == (
        f"error: --data {fifo} is a named pipe, not a file; a file is expected")  # (when parsed)


@pytest.mark.slow
def test_generate_seed_too_large_and_a_tokenizer_folder(trained: Path) -> None:
    base = _run_args(trained) + ["--prompt", "The"]
    assert _one_line(_cli("nanotron_ext.generate", base + ["--seed", str(2**70)])) == (
        f"error: --seed {2**70}: must be < 2^63")  # an OverflowError traceback
    folder = trained / "run"
    assert _one_line(_cli("nanotron_ext.generate", base + ["--tokenizer", str(folder)])) == (
        f"error: --tokenizer {folder} is a folder; a file is expected")  # it said the folder "does not exist here"


@pytest.mark.slow
def test_checkpoints_that_name_one_checkpoint_say_which_folder_to_pass(trained: Path) -> None:
    step = trained / "ckpt" / "step_2"
    got = _cli("nanotron_ext.generate", ["--run", str(trained / "run"), "--checkpoints", str(step), "--prompt", "x"])
    assert _one_line(got) == (
        f"error: no complete checkpoint in {step} (--checkpoints {step}) (step_2 is "
        f"one checkpoint: pass its folder, --checkpoints {trained / 'ckpt'}, and --step to choose)")


@pytest.mark.slow
def test_export_replica_below_zero_is_refused_before_reading(trained: Path, tmp_path: Path) -> None:
    got = _cli("nanotron_ext.export", _run_args(trained) + ["--out", str(tmp_path / "hf"), "--replica", "-1"])
    assert _one_line(got) == "error: --replica -1: must be >= 0"
    assert got.stdout == ""  # it printed "reading <checkpoint> ..." first


def _prepare(sets: List[str]) -> subprocess.CompletedProcess:
    return _cli("nanotron_ext.data", ["prepare", "--config-file", str(TINY), "--no-progress",
                                      *[a for s in sets for a in ("--set", s)]], timeout=120)


def test_data_paths_that_is_a_pipe_is_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    got = _prepare(["data.source=jsonl", f"data.paths=[{fifo}]", f"data.prepared_dir={tmp_path / 'p'}",
                    f"tokenizer.path={tmp_path / 'p' / 'tokenizer.json'}"])
    assert _one_line(got) == (f"error: data.paths[0]: {fifo} is not a file or a folder (a device or a pipe?); "
                              "data.source='jsonl' reads files")


def test_prepared_dir_that_is_a_file_and_a_tokenizer_folder(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    # was "[Errno 17] File exists ...; free space or make the folder writable"
    assert _one_line(_prepare([f"data.prepared_dir={file}"])) == (
        f"error: data.prepared_dir {file} is a file, not a folder; set data.prepared_dir to a folder")
    # was "... cannot be read (Is a directory); delete it and re-run prepare": advice to delete the user's folder
    got = _prepare([f"data.prepared_dir={tmp_path / 'p'}", f"tokenizer.path={tmp_path}",
                    "data.validation_fraction=0.5"])
    assert _one_line(got) == (f"error: tokenizer {tmp_path} is not a file (a folder?); tokenizer.path (or "
                              f"--tokenizer) names the tokenizer JSON, e.g. {tmp_path / 'tokenizer.json'}")
    assert file.read_text() == "mine\n"


@pytest.mark.parametrize("key", ["general.output_dir", "checkpoints.dir"])
def test_the_launcher_refuses_a_file_where_a_run_folder_goes(tmp_path: Path, key: str) -> None:
    # was "[Errno 20] Not a directory ...; free space there or make it writable" after start-up
    file = tmp_path / "config.yaml"
    file.write_text("mine\n")
    sets = ["parallelism.dp=1", f"general.output_dir={tmp_path / 'out'}", f"checkpoints.dir={tmp_path / 'ckpt'}",
            f"{key}={file}"]
    got = _cli("nanotron_ext.launch", ["--nproc_per_node=1", "-m", "nanotron_ext.train", "--config-file", str(TINY),
                                       *[a for s in sets for a in ("--set", s)]], timeout=120)
    assert _one_line(got) == f"error: {key} {file} is a file; give the path of a folder to write"
    assert file.read_text() == "mine\n"


@pytest.mark.parametrize("key", ["general.seed", "model.subspace.seed"])
@pytest.mark.parametrize("value", [-1, 2**70])
def test_a_seed_no_generator_takes_is_refused_at_load(key: str, value: int) -> None:
    # passed load, then every rank failed (numpy: "expected non-negative integer"; torch: OverflowError)
    got = _cli("nanotron_ext.config", ["show", "--config-file", str(TINY), "--set", f"{key}={value}"], timeout=60)
    assert _one_line(got) == f"error: {key}: must be in [0, 2^63), got {value}"
