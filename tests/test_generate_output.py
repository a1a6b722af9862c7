"""Issue 33 row 11: `python -m nanotron_ext.generate` prints the text and its one header line, nothing else; it
printed two transformers deprecation warnings (`past_key_values`, renamed `cache`) into the user's output."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, train_tiny_run

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("generate_output"))


@pytest.mark.slow
def test_generate_with_the_kv_cache_prints_no_warning(trained: Path) -> None:
    got = subprocess.run([sys.executable, "-W", "default", "-m", "nanotron_ext.generate", "--run",
                          str(trained / "run"), "--checkpoints", str(trained / "ckpt"), "--prompt", "The",
                          "--max-new-tokens", "4", "--temperature", "0", "--backend", "hf"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stderr.splitlines() == [f"[{trained / 'run'} step 2, transformers, KV cache]"]
    assert got.stdout.startswith("The")
    assert "deprecat" not in (got.stdout + got.stderr).lower()
