"""The WAN meter's arguments, checked before its first run (issue 33 row 16).

The meter trains for hours; a bad argument used to surface only when a run used it: `--steps 0` or a `--set` typo
as a traceback (or a failed run's "last error: None"), `--dry-run` outside the checkout as "config file not
found", `--from-json` of another script's result as a KeyError while rendering. Each is one line naming the
argument here (a UserFacingError; bench.wan.cli prints it and exits 2) before anything is trained or written.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple

from nanotron_ext.bench.report import read_saved
from nanotron_ext.bench.wan.presets import ANCHORS
from nanotron_ext.cli_checks import ArgumentError, at_least, finite, output_folder, seed
from nanotron_ext.config.checks import ConfigError

# what table(), figure() and the claims read of each saved row
ROW_KEYS = ("preset", "system", "seeds", "steady_step_s", "steady_step_s_se", "step_time_ratio_vs_pipeline",
            "step_time_ratio_vs_pipeline_se", "bytes_per_step", "link_wait_fraction", "final_val_loss",
            "final_val_loss_se", "target_val_loss", "time_to_target_s", "time_to_target_s_se", "reached", "curves")


def config_file(flag: str, value: str | Path, repo: Path) -> Path:
    """A config path as given (relative to the current folder), else relative to the checkout `repo`: the
    defaults name files of the checkout, which a run from another folder did not find."""
    path = Path(value).expanduser()
    for candidate in [path] if path.is_absolute() else [path, repo / path]:
        if candidate.is_file():
            return candidate.resolve()
        if candidate.exists():
            raise ArgumentError(f"{flag} {value} is not a file (a folder?); a YAML config file is expected")
    where = "" if path.is_absolute() else f" (looked in {Path.cwd()} and in the checkout {repo})"
    raise ArgumentError(f"{flag} {value} does not exist{where}")


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags, the reference and --runs."""
    at_least("--steps", args.steps, 1)
    at_least("--val-every", args.val_every, 1)  # validations are the points of the loss-vs-time curve
    at_least("--inner-steps", args.inner_steps, 1)
    at_least("--calibration-steps", args.calibration_steps, 1)
    at_least("--jobs", args.jobs, 1)
    finite("--timeout-s", args.timeout_s, 0.0, low_open=True)
    finite("--target-rel", args.target_rel, -1.0, low_open=True)  # target = loss x (1 + this) must stay > 0
    for value in args.seeds:
        seed("--seeds", value)
    if len(set(args.seeds)) < len(args.seeds):
        raise ArgumentError(f"--seeds {' '.join(map(str, args.seeds))}: a seed is given twice (one run per seed)")
    if getattr(args, "reference_given", True) and args.reference not in args.systems:  # (the default may be absent)
        raise ArgumentError(f"--reference {args.reference} is not among --systems {' '.join(args.systems)}: its "
                            "final validation loss sets the target every system is timed to")
    output_folder("--runs", args.runs)


def check_runs(runs: Mapping[str, Tuple[Path, Sequence[str]]], extra: Sequence[str]) -> None:
    """Every run's config resolves; a failure names --set when the run resolves without the `extra` overrides."""
    from nanotron_ext.config.loader import load_config

    def resolves(config: Path, overrides: Sequence[str]) -> bool:
        try:
            load_config(config, list(overrides))
        except ConfigError:
            return False
        return True

    for name, (config, overrides) in runs.items():
        try:
            load_config(config, list(overrides))
        except ConfigError as e:
            own = [o for o in overrides if o not in extra]
            blame = "--set" if extra and resolves(config, own) else f"--config {config}"
            raise ArgumentError(f"{blame} (run {name}): {e}") from None


def saved_rows(path: str, data: Mapping[str, Any]) -> Tuple[list, Dict[str, Any]]:
    """The rows and meta of a saved meter result; another script's result is refused naming the first key the
    meter needs that it lacks."""
    rows, meta = data.get("rows"), data.get("meta", {})
    if not isinstance(rows, list) or not isinstance(meta, dict):
        raise ArgumentError(f"--from-json {path}: 'rows' is not a list or 'meta' not an object; not a result of "
                            "python -m nanotron_ext.bench.wan")
    for i, row in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in row] if isinstance(row, dict) else ["(a row object)"]
        if missing:
            raise ArgumentError(f"--from-json {path}: row {i} has no {missing[0]!r}; not a result of "
                                "python -m nanotron_ext.bench.wan")
    return rows, meta


def saved_calibration(path: str, presets: Sequence[str]) -> Dict[str, Any]:
    """The anchor calibration of a saved meter result (`--calibration-from`), refused naming the file when it
    holds none or lacks the links of a calibrated preset among `presets`."""
    calibration = read_saved(path).get("meta", {}).get("anchor_calibration")
    if not isinstance(calibration, dict) or not isinstance(calibration.get("links_mbps_ms"), dict):
        raise ArgumentError(f"--calibration-from {path}: its meta has no anchor_calibration (a result of "
                            "python -m nanotron_ext.bench.wan over a calibrated preset is expected)")
    missing = [p for p in presets if p in ANCHORS and p not in calibration["links_mbps_ms"]]
    if missing:
        raise ArgumentError(f"--calibration-from {path}: it calibrated {', '.join(calibration['links_mbps_ms'])}, "
                            f"not --preset {missing[0]}")
    return {**calibration, "reused_from": path}
