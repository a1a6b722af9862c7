"""Whole training runs as reproduction rows: the trainer under torchrun, its summary and validation curve.

Convergence tables (ResBM Table 2, MAPL's main table, SM's lossy baselines, ...) compare runs of the
real trainer that differ in a few config keys; this runs one and returns what the tables need.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.bench.launch import last_error_line, launch


def run_training(config_file: str | Path, overrides: Sequence[str], run: str, *, nproc: int = 1,
                 root: Path = Path("runs/reproduce"), timeout_s: float = 7200,
                 torchrun_args: Sequence[str] = (), verbose: bool = False) -> Dict[str, Any]:
    """Train `config_file` + overrides as run `run` (fresh: its old run folder and checkpoints are
    replaced); returns summary.json plus the validation curve [(step, val_loss)] from metrics.jsonl."""
    out = root / run
    args = ["--config-file", str(config_file), "--set", f"general.output_dir={root}", "--set", f"general.run={run}",
            "--set", f"checkpoints.dir={out}/checkpoints", "--set", "checkpoints.resume=overwrite"]
    for o in overrides:
        args += ["--set", o]
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)  # a finished run would otherwise report itself complete
    rc, tail = launch("nanotron_ext.train", args, ["--nproc_per_node", str(nproc), *torchrun_args, "-m"],
                      root / f"{run}.log", timeout_s, verbose=verbose)
    if rc != 0 or not summary_path.exists():
        raise RuntimeError(f"run {run} failed (rc {rc}): {last_error_line(tail)}; log: {root / f'{run}.log'}")
    summary = json.loads(summary_path.read_text())
    summary["val_curve"] = validation_curve(out / "metrics.jsonl")
    summary["run_dir"] = str(out)
    return summary


def validation_curve(metrics: Path) -> List[List[float]]:
    """[(step, val_loss)] of a metrics.jsonl (torn lines skipped)."""
    curve: List[List[float]] = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val_loss" in rec:
            curve.append([rec["step"], rec["val_loss"]])
    return curve


def latest_checkpoint_of(summary: Dict[str, Any]) -> Optional[Path]:
    from nanotron_ext.train.checkpoint import latest_checkpoint

    return latest_checkpoint(Path(summary["run_dir"]) / "checkpoints")
