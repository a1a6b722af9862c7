"""Issue 33 rows 3, 4, 6 and 16: every command checks its arguments and the files it reads before doing any
work, and a bad one is one line naming the flag (or key) and the value or file, with exit code 2: it used to be a
wrong answer (eval --batch-size 0: loss 0, perplexity 1), a traceback, or a value that passed load."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from tests.helpers.runs import REPO, TINY, train_tiny_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("cli_checks"))


def _cli(module: str, args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _one_line(got: subprocess.CompletedProcess) -> str:
    assert got.returncode == 2, (got.returncode, got.stdout[-2000:], got.stderr[-3000:])
    return got.stderr.splitlines()[0]


def _eval(trained: Path, *args: str) -> subprocess.CompletedProcess:
    run = ["--run", str(trained / "run"), "--checkpoints", str(trained / "ckpt")]
    return _cli("nanotron_ext.eval", run + ["--data", str(trained.parent / "corpus.jsonl"), *args])


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-1"])
def test_eval_batch_size_below_one_is_refused(trained: Path, value: str) -> None:
    # row 3: printed loss 0.0000, perplexity 1.00, bits per byte 0.0000 and exit 0
    assert _one_line(_eval(trained, "--batch-size", value)) == f"error: --batch-size {value}: must be >= 1"


@pytest.mark.slow
def test_eval_json_that_is_a_folder_is_refused_before_scoring(trained: Path, tmp_path: Path) -> None:
    # row 4: an IsADirectoryError traceback, after the whole scoring
    got = _eval(trained, "--json", str(tmp_path))
    assert _one_line(got) == f"error: --json {tmp_path} is a folder; give the path of a file to write"
    assert "loss" not in got.stdout


@pytest.mark.slow
def test_eval_parquet_source_on_a_jsonl_file_is_one_line(trained: Path) -> None:
    # row 4: pyarrow's ArrowInvalid traceback
    pytest.importorskip("pyarrow")
    data = trained.parent / "corpus.jsonl"
    assert _one_line(_eval(trained, "--source", "parquet")) == (
        f"error: --data: {data} is not a parquet file (no PAR1 header); --source parquet reads parquet files: check "
        "the file or the source")


@pytest.mark.slow
@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_generate_temperature_must_be_finite_and_not_negative(trained: Path, value: str) -> None:
    # row 16: nan passed the `< 0` check
    got = _cli("nanotron_ext.generate", ["--run", str(trained / "run"), "--checkpoints", str(trained / "ckpt"),
                                         "--prompt", "The", "--temperature", value])
    assert _one_line(got) == f"error: --temperature {float(value)}: must be a finite number in [0, inf]"


def test_init_from_config_json_that_is_a_list_is_one_line(tmp_path: Path) -> None:
    # row 6: an AttributeError traceback; checked when the job starts (issue 32: not at config load)
    (tmp_path / "config.json").write_text(json.dumps([{"model_type": "llama"}]))
    got = _cli("nanotron_ext.train", ["--config-file", str(TINY), "--set", f"model.init_from=hf:{tmp_path}"])
    assert _one_line(got) == (f"error: model.init_from: {tmp_path / 'config.json'} holds a JSON list, not an "
                              "object (a transformers config.json is one object of keys)")


@pytest.mark.parametrize("sets, line", [
    (["parallelism.pp=2", 'parallelism.link.per_stage_pair={"0-1": {"bandwidth_mbps": -5}}'],
     "parallelism.link.per_stage_pair.0-1.bandwidth_mbps: must be a finite number >= 0, got -5.0"),
    (["parallelism.pp=2", 'parallelism.link.per_stage_pair={"0-1": {"latency_ms": .nan}}'],
     "parallelism.link.per_stage_pair.0-1.latency_ms: must be a finite number >= 0, got nan"),
    (["sparseloco.fault_tolerance.replicas=2", "sparseloco.fault_tolerance.min_replicas=3"],
     "sparseloco.fault_tolerance.min_replicas: must be in [1, sparseloco.fault_tolerance.replicas=2], got 3"),
])
def test_config_values_that_passed_load_are_refused_there(sets: List[str], line: str) -> None:
    # row 16: a negative bandwidth and an unreachable quorum passed load, then failed with a traceback or
    # "last error: None"
    got = _cli("nanotron_ext.config", ["show", *[a for s in sets for a in ("--set", s)]])
    assert _one_line(got) == f"config error: {line}"


def test_data_max_documents_below_one_is_refused(tmp_path: Path) -> None:
    got = _cli("nanotron_ext.data", ["prepare", "--config-file", str(REPO / "examples" / "config_tiny_llama.yaml"),
                                     "--set", f"data.prepared_dir={tmp_path / 'p'}", "--max-documents", "0"])
    assert _one_line(got) == "error: --max-documents 0: must be >= 1"
    assert not (tmp_path / "p").exists()
