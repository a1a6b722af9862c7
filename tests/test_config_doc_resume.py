"""`config doc`'s checkpoints.resume says what overwrite does since train/handover.py (issue 33 row 13): the earlier
run's checkpoints and records stay until the new run's first complete checkpoint. It still said overwrite deletes
the checkpoints first, the behaviour that lost a run when the new one stopped early. auto says which keys a resume
must keep: every technique's sections too (issue 55: MAPL's optimizer.spel used to change unnoticed)."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers.runs import REPO


def test_config_doc_says_overwrite_keeps_the_earlier_run_until_the_first_checkpoint() -> None:
    got = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "doc"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    start = lines.index("[checkpoints]")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("["))
    doc = " ".join(" ".join(lines[start:end]).split())
    assert "delete the checkpoints in `dir`, then start afresh" not in doc
    assert ("refusing one saved with other resume-defining keys (model.*, the layout, parallelism.dp_sync, "
            "optimizer.name and every technique's sections: Technique.resume_keys)") in doc
    assert ("overwrite: start afresh, leaving the earlier run's checkpoints and records (config.yaml, metrics.jsonl, "
            "summary, plot, TensorBoard) untouched while the new records go to `<run>/.overwrite/`; at the new run's "
            "first complete checkpoint both replace the earlier run's together.") in doc
