"""Issue 12, "Nothing lost, nothing silent": regression tests for the cases that have no natural home
in test_data / test_checkpoint / test_trainer / test_config (metrics, entry points, orphaned workers)."""
from __future__ import annotations

import json
from pathlib import Path

from nanotron_ext.config.schema import LoggingConfig
from nanotron_ext.metrics.logger import MetricsLogger, read_metrics


def test_resume_truncates_metrics_to_the_checkpoint_and_tolerates_a_torn_line(tmp_path: Path) -> None:
    # case 7: a torn last line broke the next run's JSON parsing; steps after the checkpoint appeared twice
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    log = MetricsLogger(tmp_path, LoggingConfig(progress_bar=False), 10, 3, is_main=True)  # resumed at step 3
    log.log({"step": 4, "loss": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    path.write_text(path.read_text() + '{"step": 5, "lo')  # a crash mid-line: still readable
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
