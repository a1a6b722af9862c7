"""The model clock against the real-sleep emulator on this machine (`python -m nanotron_ext.bench.wan
--validate-clock`): does the replay predict a step the emulator measures?

For each system (at most as many processes as cores, one run at a time, on an otherwise idle machine):

1. a run without link emulation measures this machine's compute step T0 (mean step time, first step excluded);
2. a run over the emulated preset measures the step T1;
3. the system is planned at its own scale (profile.planned) and its compute priced at the one effective
   throughput that makes the clock's step over free links equal T0 (fitted per system: this machine's FLOP/s at
   this model's shapes, optimiser and elementwise work included), then replayed over the preset's links
   (pipeline and DP tiers as the emulator applies them) for the two bounds [L, U].

It holds when 0.85 L <= T1 <= 1.15 U (issue 45: between the bounds or within 15% of them). Since that window can be
wide, each row also names the bound its trainer achieves and is held to it alone, within 15%: `upper` for a blocking
DP tier (the per-step all-reduce after the flush, the blocking outer sync), `lower` for the streaming outer sync
(the sync behind tau inner steps: sparseloco.streaming.delay) only where nothing else uses the DP tier between syncs:
one job's trainer averages the logged loss over the replicas every step, and that agreement queues on the DP link
behind the sync in flight, so such a job is held to `upper` like a blocking one; none for a pipeline (the emulator's
sends overlap in part: between the bounds). The overlap achieved, (U - T1) / (U - L), is printed beside: 0 a blocking
step, 1 the whole overlap the clock allows. Each run's effective
link / compute ratio (T1 - T0) / T0 is printed beside the clock's, and flagged when it is more than 25% outside
the clock's range: a loaded machine stretches compute, not the sleeps, and reads as a smaller ratio.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from nanotron_ext.bench.clock import (
    RATIO_TOLERANCE,
    config_links,
    free_step_s,
    mean_step_s,
    planned,
    step_bounds_of,
    twin_overrides,
)
from nanotron_ext.bench.wan.systems import SYSTEMS, run_overrides, system_config

VALIDATION_SYSTEMS = ("pipeline", "int4_pipeline", "ddp", "sparseloco", "sparseloco_streaming",
                      "sparseloco_streaming4")
TITLE = "The model clock against the real-sleep emulator (one run at a time, processes <= cores)"
TOLERANCE = 0.15


def validate_system(system: str, preset: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One system's row (the module docstring)."""
    from nanotron_ext.bench.training import run_training
    from nanotron_ext.cli_checks import ArgumentError
    from nanotron_ext.config import load_config

    s, config = SYSTEMS[system], str(system_config(system, args))
    measured = {}
    for mode, link_preset in (("free", None), ("emulated", preset)):
        sets = run_overrides(system, link_preset, args.seeds[0], args)
        if link_preset is None:
            sets.append("parallelism.link.enabled=false")
        summary = run_training(config, sets, f"clock_validation_{system}_{mode}", nproc=s.nproc,
                               root=Path(args.runs), timeout_s=args.timeout_s, reuse=args.reuse)
        measured[mode] = (mean_step_s(Path(summary["run_dir"])), os.getloadavg()[0])
    t0, t1 = measured["free"][0], measured["emulated"][0]
    plan = planned(config, twin_overrides(config, run_overrides(system, None, args.seeds[0], args), None),
                   Path(args.runs) / "plans")
    flops_per_s = free_step_s(plan, 1.0) / t0  # the clock's seconds at 1 FLOP/s over the measured compute step
    links = config_links(load_config(config, run_overrides(system, preset, args.seeds[0], args)).parallelism.link)
    if links is None:
        raise ArgumentError(f"--validate-clock --systems {system}: parallelism.link.per_stage_pair gives its stage "
                            "pairs links of their own; the clock takes one link per replica")
    tiers, stage = links
    b = step_bounds_of(plan, tiers, [stage] * plan["layout"]["dp"], flops_per_s)
    ratio, low_ratio, high_ratio = (t1 - t0) / t0, (b.lower_s - t0) / t0, (b.upper_s - t0) / t0
    return {"system": system, "preset": preset, "processes": s.nproc, "compute_step_s": t0, "measured_step_s": t1,
            "clock_lower_s": b.lower_s, "clock_upper_s": b.upper_s, "fitted_gflops": flops_per_s / 1e9,
            "held": (1 - TOLERANCE) * b.lower_s <= t1 <= (1 + TOLERANCE) * b.upper_s,
            "link_over_compute": ratio, "clock_link_over_compute": [low_ratio, high_ratio],
            "ratio_flag": not ((1 - RATIO_TOLERANCE) * low_ratio <= ratio <= (1 + RATIO_TOLERANCE) * high_ratio),
            "loadavg_1m": {mode: load for mode, (_, load) in measured.items()},
            **judge(t1, b.lower_s, b.upper_s, plan, b.agreements_s)}


def judge(measured_s: float, lower_s: float, upper_s: float, plan: Dict[str, Any],
          agreements_s: float = 0.0) -> Dict[str, Any]:
    """The measured step against the one bound its trainer achieves (`trainer_bound`), and the overlap achieved;
    its distance from the full-overlap bound is kept beside (`off_lower`)."""
    achieved = trainer_bound(plan, agreements_s)
    at = {"lower": lower_s, "upper": upper_s}.get(achieved)
    return {"trainer_bound": achieved, "off_trainer_bound": None if at is None else measured_s / at - 1,
            "off_lower": measured_s / lower_s - 1, "agreements_s": agreements_s,
            "held_trainer_bound": None if at is None else abs(measured_s / at - 1) <= TOLERANCE,
            "overlap_achieved": (upper_s - measured_s) / (upper_s - lower_s) if upper_s > lower_s else None,
            "outer_overlap": plan.get("outer_overlap", 0)}


def trainer_bound(plan: Dict[str, Any], agreements_s: float = 0.0) -> str:
    """The bound this project's trainer achieves for a planned system (module docstring): "lower" for a streaming
    outer sync with nothing else on the DP tier, "upper" for a DP tier that blocks (a streaming sync with per-step
    agreements queued behind it included), "" for a pipeline (partly overlapped sends: no single bound)."""
    if plan.get("outer_overlap") and not agreements_s:
        return "lower"
    return "" if plan["layout"]["pp"] > 1 else "upper"


def table(rows: List[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["system", "preset", "processes", "compute step s (no links)", "measured step s (emulated)",
               "clock s [full overlap, none]", "within 15%", "trainer's bound", "measured / that bound",
               "measured / full overlap",
               "overlap achieved", "link/compute measured", "link/compute clock", "ratio off > 25%",
               "load 1 min (free, emulated)"]
    body = []
    for r in rows:
        bound = r.get("trainer_bound", "")
        off = r.get("off_trainer_bound")
        overlap = r.get("overlap_achieved")
        body.append([r["system"], r["preset"], r["processes"], f"{r['compute_step_s']:.3f}",
                     f"{r['measured_step_s']:.3f}", f"[{r['clock_lower_s']:.3f}, {r['clock_upper_s']:.3f}]",
                     "yes" if r["held"] else "NO",
                     (f"{bound} (tau {r['outer_overlap']}" + (", agreements queue behind the sync)"
                                                              if r.get("agreements_s") else ")")
                      if r.get("outer_overlap") else bound) or "none (between)",
                     "-" if off is None else f"{1 + off:.2f}" + ("" if r["held_trainer_bound"] else " NO"),
                     f"{r['measured_step_s'] / r['clock_lower_s']:.2f}",
                     "-" if overlap is None else f"{overlap:.2f}", f"{r['link_over_compute']:.2f}",
                     f"[{r['clock_link_over_compute'][0]:.2f}, {r['clock_link_over_compute'][1]:.2f}]",
                     "FLAG" if r["ratio_flag"] else "-", ", ".join(f"{v:.1f}" for v in r["loadavg_1m"].values())])
    return headers, body


def notes(rows: List[Dict[str, Any]]) -> List[str]:
    held = sum(r["held"] for r in rows)
    judged = [r for r in rows if r.get("held_trainer_bound") is not None]
    flagged = [r["system"] for r in rows if r["ratio_flag"]]
    return [f"{held} of {len(rows)} measured steps within 15% of the clock's bounds "
            "[0.85 x full overlap, 1.15 x no overlap]; compute fitted per system on its run without links.",
            f"{sum(r['held_trainer_bound'] for r in judged)} of {len(judged)} within 15% of the one bound their "
            "trainer achieves (upper: a blocking DP tier, or a streaming sync whose job's per-step agreements queue "
            "behind it on the DP link; lower: a streaming sync with nothing else on that link); "
            "the pipelines have no single bound (their sends overlap in part).",
            "link/compute ratio more than 25% outside the clock's: " + (", ".join(flagged) if flagged else "none")]
