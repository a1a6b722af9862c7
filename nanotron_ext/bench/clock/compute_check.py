"""Every emulated run's compute check (issue 45, item 4): was the run's link / compute ratio the preset's?

A preset fixes the links in seconds; what a real-sleep run means depends on its compute taking what one device per
process takes. On an oversubscribed machine compute stretches and the sleeps do not, so the run's effective
link / compute ratio shrinks (the review's dense 3D: 0.6x where the preset meant 9-14x). The check needs no extra
run:

1. every rank records its CPU seconds per step (metrics/step_meter.py, with link emulation on): the step's compute
   as one core per process would take it, whatever the load (the launcher runs one thread per process);
2. the run is planned (profile.planned: FLOPs and every message per rank) and priced at the one throughput that
   makes the job's FLOPs take the job's CPU seconds, then replayed by the model clock over free links (the compute
   step C, bubbles included) and over the run's own emulated links ([L, U], the two overlap bounds);
3. the compute stretch: the factors s by which the clock's compute must be slowed for its step over the run's links
   to equal the measured step T (one per bound; the no-overlap bound needs the smaller). The links being sleeps,
   the run's effective link / compute ratio is the preset's / s, so it is flagged when no s in that range lies
   within [1 / 1.25, 1 / 0.75] (the ratio more than 25% off).

A run whose processes each had a core reads s near 1; one with 4 processes per core near 4.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.bench.clock.replay import Link

RATIO_TOLERANCE = 0.25


def mean_step_s(run_dir: Path) -> float:
    """Mean step time of a run, its first step excluded (an outer sync's step counts, amortised as the clock does)."""
    from nanotron_ext.metrics.logger import read_metrics

    times = [r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in r]
    return statistics.fmean(times[1:] or times)


def config_links(link: Any) -> Optional[Tuple[Dict[str, Link], Link]]:
    """The clock's links of a loaded `parallelism.link` section (presets already resolved to numbers): the TP and
    DP tiers and the stage link; None when stage pairs have their own links (the clock takes one per replica)."""
    if link.per_stage_pair:
        return None
    tier = lambda t: Link(float(t.bandwidth_mbps), float(t.latency_ms), t.duplex)  # noqa: E731
    return {"tp": tier(link.tp), "dp": tier(link.dp)}, tier(link)


def job_flops(plan: Dict[str, Any]) -> float:
    """FLOPs of one training step over every rank of the job: each planned rank stands for the TP ranks of its
    stage and the replicas that share its config (as profile.bytes_per_step counts bytes)."""
    from nanotron_ext.bench.clock.pricing import replica_counts

    counts = replica_counts(plan)
    return sum(counts[i] * plan["layout"]["tp"] * rank["flops"]
               for i, column in enumerate(plan["inner"]) for rank in column)


def _stretch(plan: Dict[str, Any], tiers: Dict[str, Link], stage: Link, flops_per_s: float, step_s: float,
             bound: str) -> float:
    """The compute stretch s at which `bound` of the clock's step equals `step_s` (bisection: the step grows with s;
    clamped to [1e-3, 1e3])."""
    from nanotron_ext.bench.clock.pricing import step_bounds_of

    def step(s: float) -> float:
        return getattr(step_bounds_of(plan, tiers, [stage] * plan["layout"]["dp"], flops_per_s / s), bound)

    low, high = 1e-3, 1e3
    for _ in range(60):  # 2^-60 of six decades: far below the step times' own noise
        mid = (low * high) ** 0.5
        low, high = (mid, high) if step(mid) < step_s else (low, mid)
    return (low * high) ** 0.5


def priced_at_cpu_seconds(plan: Dict[str, Any], rank_cpu_s: Sequence[float], tiers: Dict[str, Link],
                          stage: Link) -> Tuple[float, float, Any]:
    """The clock priced at a run's own CPU seconds: (the throughput at which the job's FLOPs take the ranks' CPU
    seconds, the step over free links at it, the StepBounds over `tiers` and `stage` at it)."""
    from nanotron_ext.bench.clock.pricing import free_step_s, step_bounds_of

    flops_per_s = job_flops(plan) / sum(rank_cpu_s)
    bounds = step_bounds_of(plan, tiers, [stage] * plan["layout"]["dp"], flops_per_s)
    return flops_per_s, free_step_s(plan, flops_per_s), bounds


def check(plan: Dict[str, Any], link: Any, rank_cpu_s: List[float], step_s: float) -> Dict[str, Any]:
    """The check of one run (module docstring): `plan` its plan, `link` its loaded `parallelism.link`,
    `rank_cpu_s` every rank's CPU seconds per step, `step_s` its measured step."""
    links = config_links(link)
    if links is None or not rank_cpu_s or sum(rank_cpu_s) <= 0:
        return {"compute_check": "not checked (per-stage-pair links or no CPU seconds recorded)"}
    tiers, stage = links
    flops_per_s, compute_s, b = priced_at_cpu_seconds(plan, rank_cpu_s, tiers, stage)
    stretch = [_stretch(plan, tiers, stage, flops_per_s, step_s, bound) for bound in ("upper_s", "lower_s")]
    low, high = 1 / (1 + RATIO_TOLERANCE), 1 / (1 - RATIO_TOLERANCE)
    return {"rank_cpu_step_s": rank_cpu_s, "compute_step_s": compute_s, "measured_step_s": step_s,
            "clock_step_s": [b.lower_s, b.upper_s], "compute_stretch": stretch,
            "clock_link_over_compute": [(b.lower_s - compute_s) / compute_s, (b.upper_s - compute_s) / compute_s],
            "ratio_flag": stretch[1] < low or stretch[0] > high}


def note(runs: Sequence[Dict[str, Any]]) -> str:
    """One line for a result's notes: how many runs had the preset's link / compute ratio, which did not."""
    checked = [r for r in runs if isinstance(r.get("compute_check"), dict) and "ratio_flag" in r["compute_check"]]
    flagged = [f"{r['system']} seed {r['seed']} (compute {r['compute_check']['compute_stretch'][0]:.2f}-"
               f"{r['compute_check']['compute_stretch'][1]:.2f}x its CPU seconds)"
               for r in checked if r["compute_check"]["ratio_flag"]]
    head = ("Compute check (each run's step against the model clock at its ranks' CPU seconds: link / compute "
            f"within {RATIO_TOLERANCE:.0%} of the preset's): {len(checked) - len(flagged)} of {len(checked)} runs "
            "within")
    return head + ("; flagged (compute stretched by load): " + ", ".join(flagged) if flagged else "") + \
        (f"; {len(runs) - len(checked)} not checked" if len(runs) > len(checked) else "")
