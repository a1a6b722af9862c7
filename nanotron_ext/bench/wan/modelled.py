"""The meter with the model clock (`--clock model`): learning curves from the cheapest equivalent layouts
(losses.py), each system's step replayed on every `--clock-preset` (profile.py, clock.py), pooled into time to
target on the clock (model_results.py)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Tuple

from nanotron_ext.bench.clock import CLOCK_PRESETS, bytes_per_step, links_of, planned, step_bounds_of, twin_overrides
from nanotron_ext.bench.wan import model_results
from nanotron_ext.bench.wan.losses import loss_runs, train_all
from nanotron_ext.bench.wan.systems import REPO, run_overrides, system_config

TITLE = "Time to a target validation loss on the model clock (losses: cheapest equivalent layouts; time: replayed)"


def clock_of(system: str, preset: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One system's step on one preset: both bounds, its bytes per tier per step (planned and closed form) and its
    tokens per step, all at the preset's scale."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step

    p = CLOCK_PRESETS[preset]
    config = str(system_config(system, args))
    scale = str(REPO / p.scale_config) if p.scale_config else None  # none: timed at the size it trains
    twin = twin_overrides(config, run_overrides(system, None, args.seeds[0], args), scale)
    plan = planned(config, twin, Path(args.runs) / "plans")
    tiers, stage = links_of(p, plan["layout"]["dp"])
    bounds = step_bounds_of(plan, tiers, stage, p.tflops * 1e12)
    cfg = load_config(config, twin)
    t = cfg.tokens
    return {"lower_s": bounds.lower_s, "upper_s": bounds.upper_s, "bytes_per_step": bytes_per_step(plan),
            "closed_form_bytes_per_step": job_bytes_per_step(cfg),
            "tokens_per_step": cfg.parallelism.dp * t.micro_batch_size * t.batch_accumulation_per_replica
            * t.sequence_length, "outer_every": plan["outer_every"]}


def measure_model(args: argparse.Namespace) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[Dict[str, Any]]]:
    """Loss runs, the clock on every preset, the pooled rows; (rows, meta, curves)."""
    from nanotron_ext.bench.report import run_meta

    curves = train_all(loss_runs(args.systems, args.seeds, args), Path(args.runs) / "losses", args.jobs)
    clocks = {(preset, system): clock_of(system, preset, args)
              for preset in args.clock_preset for system in args.systems}
    rows = model_results.pooled_rows(curves, clocks, args.reference, args.target_rel)
    if args.equal_time:
        timed, rows_time = equal_time(rows, clocks, args)
        curves, rows = curves + timed, rows + rows_time
    meta = run_meta({
        "clock": "model", "steps": args.steps, "val_every": args.val_every, "inner_steps": args.inner_steps,
        "seeds": args.seeds, "reference": args.reference, "target_rel": args.target_rel, "config": args.config,
        "set": args.set, "equal_time": args.equal_time, "max_steps": args.max_steps,
        "equal_time_seeds": args.equal_time_seeds,
        "clock_presets": {name: dataclasses.asdict(CLOCK_PRESETS[name]) for name in args.clock_preset},
        "clocks": {f"{preset} {system}": c for (preset, system), c in clocks.items()},
        "note": "losses from one process per run (cheapest equivalent layout, no link emulation; loss runs' "
                "timing is not used); step times from the model clock at each preset's scale and hardware"})
    return rows, meta, [{k: v for k, v in c.items() if k != "train_loss"} for c in curves]


def equal_time(rows: List[Dict[str, Any]], clocks: Dict[Tuple[str, str], Dict[str, Any]],
               args: argparse.Namespace) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """The equal-time budget (`--equal-time SYSTEM ...`): on each preset, each named system trains for the
    reference's time to target on the clock (full-overlap bound) at its own step time, its schedule over that many
    steps (at most `--max-steps`); the rows pool those runs against the equal-token target. Every run of every
    preset trains in one batch (`--jobs` at a time; presets that give a system the same steps share its runs).
    (curves, rows)"""
    plan = []  # (preset, system, steps, budget_s, target, runs)
    for preset in args.clock_preset:
        ref = next(r for r in rows if r["preset"] == preset and r["system"] == args.reference)
        budget_s = ref["time_to_target_s"]["lower"][0]
        if budget_s is None:
            continue  # the reference never reached its own target: no time to match
        for system in args.equal_time:
            steps = min(args.max_steps, max(1, int(budget_s / clocks[(preset, system)]["lower_s"])))
            steps -= steps % args.val_every if steps >= args.val_every else 0  # end on a validation
            mine = argparse.Namespace(**{**vars(args), "steps": steps})
            plan.append((preset, system, steps, budget_s, ref["target_val_loss"],
                         loss_runs([system], args.equal_time_seeds, mine)))
    trained = train_all([r for *_, runs in plan for r in runs], Path(args.runs) / "losses", args.jobs)
    curves, out, at = [], [], 0
    for preset, system, steps, budget_s, target, runs in plan:
        got, at = trained[at:at + len(runs)], at + len(runs)
        curves += [{**c, "budget": f"equal time on {preset}"} for c in got]
        for row in model_results.pooled_rows(got, {(preset, system): clocks[(preset, system)]}, args.reference,
                                             args.target_rel, target=target):
            out.append({**row, "budget": "time", "budget_steps": steps, "budget_s": budget_s})
    return curves, out


def publish_model(out: str, rows: List[Dict[str, Any]], meta: Dict[str, Any], curves: List[Dict[str, Any]]) -> int:
    from nanotron_ext.bench.report import publish

    headers, body = model_results.table(rows)
    notes = [*model_results.headline(rows),
             f"Target = {meta['reference']}'s final validation loss x {1 + meta['target_rel']:g}; time to target = "
             "steps to the first validation at or below it x the clock's step (full overlap | no overlap). "
             f"{meta['note']}."]
    publish(out, rows, meta, TITLE, headers, body, (), model_results.figure(rows), notes, extra={"runs": curves})
    return 0
