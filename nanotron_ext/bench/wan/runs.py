"""The WAN meter's real-sleep runs (`--clock emulated`): each system trained in its real layout over emulated links
(parallel/link.py), its step times read from metrics.jsonl; the calibrated presets' links scaled to this machine."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from nanotron_ext.bench.wan.args import config_file
from nanotron_ext.bench.wan.presets import (
    ANCHORS,
    CALIBRATION_SYSTEM,
    TIERS,
    describe,
    scaled_link,
    tier_seconds_at_1mbps,
)
from nanotron_ext.bench.wan.results import run_curve
from nanotron_ext.bench.wan.systems import REPO, SYSTEMS, run_overrides, system_config


def measure_run(system: str, preset: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    from nanotron_ext.bench.training import run_training
    from nanotron_ext.metrics.logger import read_metrics

    s = SYSTEMS[system]
    summary = run_training(system_config(system, args), run_overrides(system, preset, seed, args),
                           f"{preset}_{system}_seed{seed}", nproc=s.nproc, root=Path(args.runs),
                           timeout_s=args.timeout_s, reuse=args.reuse)
    curve = run_curve(read_metrics(Path(summary["run_dir"]) / "metrics.jsonl"))
    comm = summary["comm_bytes_per_step"]
    return {"system": system, "preset": preset, "seed": seed, **curve,
            "bytes_per_step": {t: comm.get(t, 0) for t in TIERS},
            "closed_form_bytes_per_step": closed_forms(system, preset, seed, args),
            "link_wait_fraction": summary.get("link_wait_fraction", {}), "final_val_loss": summary["final_val_loss"],
            "compute_check": compute_check_of(system, preset, seed, args, summary)}


def compute_check_of(system: str, preset: str, seed: int, args: argparse.Namespace,
                     summary: Mapping[str, Any]) -> Dict[str, Any]:
    """The run's compute check (bench/clock/compute_check.py): its link / compute ratio against the clock's."""
    from nanotron_ext.bench.clock import check_compute, mean_step_s, planned, twin_overrides
    from nanotron_ext.config import load_config

    if "rank_cpu_step_s" not in summary:  # a run trained before runs recorded their CPU seconds (--reuse)
        return {"compute_check": "not checked (the run recorded no CPU seconds)"}
    config = str(system_config(system, args))
    plan = planned(config, twin_overrides(config, run_overrides(system, None, seed, args), None),
                   Path(args.runs) / "plans")
    link = load_config(config, run_overrides(system, preset, seed, args)).parallelism.link
    return check_compute(plan, link, summary["rank_cpu_step_s"], mean_step_s(Path(summary["run_dir"])))


def closed_forms(system: str, preset: str, seed: int, args: argparse.Namespace) -> Dict[str, Optional[float]]:
    """Each tier's bytes per step by closed form, all ranks (nanotron_ext.metrics.tier_bytes), for one run's
    config: what the ledger column should read, up to the side traffic the forms leave out."""
    from nanotron_ext.config import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step

    forms = job_bytes_per_step(load_config(system_config(system, args), run_overrides(system, preset, seed, args)))
    return {t: forms.get(t, 0.0) for t in TIERS}


def calibrate_anchors(args: argparse.Namespace) -> Dict[str, Any]:
    """The calibrated presets' links scaled to this machine (bench/wan/presets.py): one run without link
    emulation of each tier's uncompressed system measures its compute step and its bytes on that tier."""
    from nanotron_ext.bench.training import run_training
    from nanotron_ext.config import load_config
    from nanotron_ext.metrics.logger import read_metrics

    anchors = {name: ANCHORS[name].tiers() for name in args.preset if name in ANCHORS}
    measured: Dict[str, Dict[str, Any]] = {}
    for tier in sorted({t for tiers in anchors.values() for t in tiers}):
        system = CALIBRATION_SYSTEM[tier]
        sets = [*SYSTEMS[system].overrides, "parallelism.link.enabled=false",
                f"tokens.train_steps={args.calibration_steps}", "tokens.val_check_interval=0",
                "logging.progress_bar=false", *args.set]
        config = config_file("--config", args.config, REPO)
        summary = run_training(config, sets, f"anchor_calibration_{tier}", nproc=SYSTEMS[system].nproc,
                               root=Path(args.runs), timeout_s=args.timeout_s, reuse=args.reuse)
        p = load_config(config, sets).parallelism
        comm = summary["comm_bytes_per_step"]
        # the stage link: its activation and gradient sends (not headers, not the emulator's clock sync); TP and
        # DP: the tier's total, as all-reduces (Megatron's and DDP's collectives; the summary keeps no op split)
        ops = ({op: comm.get(f"pp:{op}", 0) for op in ("send:fwd", "send:bwd")} if tier == "pp"
               else {"all_reduce": comm.get(tier, 0)})
        measured[tier] = {"system": system, "bytes_by_op": ops, "dp": p.dp, "tp": p.tp, "pp": p.pp,
                          "compute_step_s": run_curve(read_metrics(Path(summary["run_dir"]) / "metrics.jsonl"))[
                              "steady_step_s"]}
    links = {}
    for name, tiers in anchors.items():
        links[name] = {}
        for tier, anchor in tiers.items():
            m = measured[tier]
            at_1mbps = tier_seconds_at_1mbps(tier, m["bytes_by_op"], m["dp"], m["tp"], m["pp"], anchor.duplex)
            links[name][tier] = [round(v, 4) for v in scaled_link(at_1mbps, m["compute_step_s"], anchor)]
    return {"tiers": measured, "links_mbps_ms": links,
            "sources": {name: describe(name) for name in anchors}}


def links_of(calibration: Mapping[str, Any]) -> Dict[str, Dict[str, Tuple[float, float]]]:
    """{preset: {tier: (Mbit/s, ms)}} of a calibration (run_overrides' `args.anchor_links`)."""
    return {name: {tier: tuple(v) for tier, v in links.items()}
            for name, links in calibration["links_mbps_ms"].items()}
