"""Whole training runs as reproduction rows: the trainer under torchrun, its summary and validation curve.

Convergence tables (ResBM Table 2, MAPL's main table, SM's lossy baselines, ...) compare runs of the
real trainer that differ in a few config keys; this runs one and returns what the tables need.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from nanotron_ext.bench.launch import last_error_line, launch
from nanotron_ext.config.loader import config_to_dict, load_config
from nanotron_ext.errors import UserFacingError


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
    from nanotron_ext.config.loader import load_config

    load_config(config_file, sets)  # a damaged config or a bad --set: its one line (ConfigError), nothing launched
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
    """The run folder holds a finished run whose saved config equals this resolved config. A damaged one (its
    summary.json, config.yaml or metrics.jsonl unreadable or of another shape) is named on stderr and trained
    again: it used to fail the run with a bare JSONDecodeError naming neither the folder nor the file."""
    if not (out / "summary.json").exists() or not (out / "config.yaml").exists():
        return False
    want = config_to_dict(load_config(config_file, list(sets)))
    try:
        have, steps = _saved_run(out)
    except UserFacingError as e:
        print(f"--reuse: run {out} is damaged and is trained again: {e}", file=sys.stderr, flush=True)
        return False
    return want == have and steps == want["tokens"]["train_steps"]


def _saved_run(out: Path) -> Tuple[Dict[str, Any], Any]:
    """The saved config and summary steps of a finished run folder, and its metrics readable (what --reuse reads
    back); a damaged file is a UserFacingError naming it."""
    from nanotron_ext.cli_checks import JsonFile
    from nanotron_ext.metrics.logger import read_metrics

    summary = JsonFile(out / "summary.json", "summary", UserFacingError).read_object()
    config = out / "config.yaml"
    try:
        have = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:  # (UnicodeDecodeError is a ValueError)
        raise UserFacingError(f"config {config} cannot be read ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(have, dict):
        raise UserFacingError(f"config {config} holds no mapping of sections")
    try:
        read_metrics(out / "metrics.jsonl")
    except (OSError, ValueError) as e:
        raise UserFacingError(str(e)) from None  # (names the file)
    return have, summary.get("steps")


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
