"""The WAN meter's arguments, checked before its first run (issue 33 row 16).

The meter trains for hours; a bad argument used to surface only when a run used it: `--steps 0` or a `--set` typo
as a traceback (or a failed run's "last error: None"), `--dry-run` outside the checkout as "config file not
found", `--from-json` of another script's result as a KeyError while rendering. Each is one line naming the
argument here (a UserFacingError; bench.wan.cli prints it and exits 2) before anything is trained or written.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple

from nanotron_ext.bench.report import read_saved
from nanotron_ext.bench.wan.presets import ANCHORS, TIERS
from nanotron_ext.cli_checks import ArgumentError, JsonFile, input_file, json_kind
from nanotron_ext.config.checks import ConfigError

# what table(), figure() and the claims read of each saved row
ROW_KEYS = ("preset", "system", "seeds", "steady_step_s", "steady_step_s_se", "step_time_ratio_vs_pipeline",
            "step_time_ratio_vs_pipeline_se", "bytes_per_step", "link_wait_fraction", "final_val_loss",
            "final_val_loss_se", "target_val_loss", "time_to_target_s", "time_to_target_s_se", "reached", "curves")


def config_file(flag: str, value: str | Path, repo: Path) -> Path:
    """A config path as given (relative to the current folder), else relative to the checkout: the defaults name
    files of the checkout, which a run from another folder did not find (cli_checks.input_file's rule; the flag's
    type checked it when parsed)."""
    del repo  # the checkout is input_file's
    return input_file(flag, value, checkout=True).resolve()


def check_numbers(args: argparse.Namespace) -> None:
    """What the flags' types cannot see alone (each value was checked when parsed): seeds given twice, the
    reference among the systems."""
    if len(set(args.seeds)) < len(args.seeds):
        raise ArgumentError(f"--seeds {' '.join(map(str, args.seeds))}: a seed is given twice (one run per seed)")
    if getattr(args, "reference_given", True) and args.reference not in args.systems:  # (the default may be absent)
        raise ArgumentError(f"--reference {args.reference} is not among --systems {' '.join(args.systems)}: its "
                            "final validation loss sets the target every system is timed to")


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
    holds none, lacks the links of a calibrated preset among `presets` (or of one of its tiers), or holds links
    no run can use (check_calibration)."""
    meta = read_saved(path, "--calibration-from").get("meta", {})
    calibration = meta.get("anchor_calibration") if isinstance(meta, dict) else None
    if not isinstance(calibration, dict) or not isinstance(calibration.get("links_mbps_ms"), dict):
        raise ArgumentError(f"--calibration-from {path}: its meta has no anchor_calibration (a result of "
                            "python -m nanotron_ext.bench.wan over a calibrated preset is expected)")
    again = "calibrate again (the same command without --calibration-from)"
    links = check_calibration(JsonFile(Path(path), "--calibration-from", advice=again), calibration)
    missing = [p for p in presets if p in ANCHORS and p not in links]
    if missing:
        raise ArgumentError(f"--calibration-from {path}: it calibrated {', '.join(links)}, "
                            f"not --preset {missing[0]}")
    for preset in (p for p in presets if p in ANCHORS):
        tier = next((t for t in ANCHORS[preset].tiers() if t not in links[preset]), None)
        if tier is not None:
            raise ArgumentError(f"--calibration-from {path}: preset {preset} has no calibrated {tier} link; {again}")
    return {**calibration, "reused_from": path}


def check_calibration(f: JsonFile, calibration: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A saved anchor calibration's links {preset: {tier: [Mbit/s, ms]}}, each a link the emulator can run: a
    bandwidth that is a finite number > 0 (0 means unlimited: no link would be emulated, and the runs would time
    an unlimited link as the preset), a latency that is a finite number >= 0. Refused naming the file, the preset
    and the tier."""
    where = "meta.anchor_calibration.links_mbps_ms"
    links = f.need(calibration, "links_mbps_ms", dict, "meta.anchor_calibration")
    for preset in links:
        tiers = f.need(links, preset, dict, where)
        for tier, link in tiers.items():
            name = f"preset {preset} tier {tier}"
            if not isinstance(link, list) or len(link) != 2:
                f.fail(f"{name}: {json_kind(link)} where a link [Mbit/s, ms] is expected")
            bandwidth, latency = link
            if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
                    not math.isfinite(bandwidth) or bandwidth <= 0:
                f.fail(f"{name}: bandwidth {bandwidth!r} Mbit/s is not a finite number > 0 (0 means unlimited: no "
                       "link would be emulated)")
            if isinstance(latency, bool) or not isinstance(latency, (int, float)) or \
                    not math.isfinite(latency) or latency < 0:
                f.fail(f"{name}: latency {latency!r} ms is not a finite number >= 0")
    return links


def check_saved_runs(flag: str, path: str, saved: Mapping[str, Any]) -> None:
    """What pooling reads of a saved result (--merge), refused naming the flag, the file, the run and the key: the
    meta's steps, target and reference, its calibration's links, and each run's names, step time, losses and
    bytes, as finite numbers (a NaN loss was a traceback inside the statistics)."""
    f = JsonFile(Path(path), flag)
    meta = f.need(saved, "meta", dict)
    f.need(meta, "steps", int, "meta")
    f.number(meta, "target_rel", "meta", low=-1.0, low_open=True)
    f.need(meta, "reference", str, "meta")
    calibration = f.need(meta, "anchor_calibration", dict, "meta", optional=True)
    if calibration is not None:
        check_calibration(f, calibration)
    runs = f.need(saved, "runs", list)
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            f.fail(f"{where} is {json_kind(run)}, not an object")
        for key in ("system", "preset"):
            f.need(run, key, str, where)
        f.need(run, "seed", int, where)
        where = f"runs[{i}] ({run['system']} seed {run['seed']} on {run['preset']})"
        f.number(run, "steady_step_s", where, low=0.0, low_open=True)
        f.number(run, "final_val_loss", where, optional=True)
        for j, point in enumerate(f.need(run, "val_vs_wall", list, where)):
            if not (isinstance(point, list) and len(point) == 2):
                f.fail(f"{where}.val_vs_wall[{j}] is {json_kind(point)}, not [wall-clock s, validation loss]")
            f.number({"wall-clock s": point[0], "validation loss": point[1]}, "wall-clock s",
                     f"{where}.val_vs_wall[{j}]", low=0.0)
            f.number({"validation loss": point[1]}, "validation loss", f"{where}.val_vs_wall[{j}]")
        bytes_per_step = f.need(run, "bytes_per_step", dict, where)
        for tier in TIERS:
            f.number(bytes_per_step, tier, f"{where}.bytes_per_step", low=0.0)
        for key in ("link_wait_fraction", "closed_form_bytes_per_step"):
            table = f.need(run, key, dict, where, optional=True) or {}
            for tier in table:
                f.number(table, tier, f"{where}.{key}", optional=True)
