"""Whole training runs as reproduction rows: the trainer under torchrun, its summary and validation curve.

Convergence tables (ResBM Table 2, MAPL's main table, SM's lossy baselines, ...) compare runs of the
real trainer that differ in a few config keys; this runs one and returns what the tables need.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from nanotron_ext.bench.launch import last_error_line, launch
from nanotron_ext.config.loader import config_to_dict, load_config


def run_training(config_file: str | Path, overrides: Sequence[str], run: str, *, nproc: int = 1,
                 root: Path = Path("runs/reproduce"), timeout_s: float = 7200,
                 torchrun_args: Sequence[str] = (), verbose: bool = False, reuse: bool = False) -> Dict[str, Any]:
    """Train `config_file` + overrides as run `run` (fresh: its old run folder and checkpoints are
    replaced); returns summary.json plus the validation curve [(step, val_loss)] from metrics.jsonl.
    With `reuse`, a finished run of exactly this resolved config is read instead of trained again (a
    long sweep that stopped resumes where it stopped)."""
    out = root / run
    sets = [f"general.output_dir={root}", f"general.run={run}", f"checkpoints.dir={out}/checkpoints",
            "checkpoints.resume=overwrite", *overrides]
    summary_path = out / "summary.json"
    if reuse and _finished_with(out, config_file, sets):
        return _result(out)
    args = ["--config-file", str(config_file)]
    for o in sets:
        args += ["--set", o]
    summary_path.unlink(missing_ok=True)  # a finished run would otherwise report itself complete
    rc, tail = launch("nanotron_ext.train", args, ["--nproc_per_node", str(nproc), *torchrun_args, "-m"],
                      root / f"{run}.log", timeout_s, verbose=verbose)
    if rc != 0 or not summary_path.exists():
        raise RuntimeError(f"run {run} failed (rc {rc}): {last_error_line(tail)}; log: {root / f'{run}.log'}")
    return _result(out)


def _result(out: Path) -> Dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    summary["val_curve"] = validation_curve(out / "metrics.jsonl")
    summary["run_dir"] = str(out)
    return summary


def _finished_with(out: Path, config_file: str | Path, sets: Sequence[str]) -> bool:
    """The run folder holds a finished run whose saved config equals this resolved config."""
    if not (out / "summary.json").exists() or not (out / "config.yaml").exists():
        return False
    want = config_to_dict(load_config(config_file, list(sets)))
    have = yaml.safe_load((out / "config.yaml").read_text())
    steps = json.loads((out / "summary.json").read_text()).get("steps")
    return want == have and steps == want["tokens"]["train_steps"]


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
    # torch on the worker side only: orchestrators run without it
    from nanotron_ext.train.checkpoint import latest_checkpoint

    return latest_checkpoint(Path(summary["run_dir"]) / "checkpoints")
