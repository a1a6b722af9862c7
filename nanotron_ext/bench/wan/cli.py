"""The meter: over MY links, which system reaches a given loss soonest?

Every system trains the same model on the same data for the same token budget (the same tokens per
step and steps) through the real trainer, over the same emulated link preset (parallelism.link: the
preset on the pipeline stage pairs and on the DP / outer-sync group, `--tp-preset` on the TP group;
parallel/link.py), and the meter reports per system, mean and standard error over seeds:

- steady step time: the median step time of metrics.jsonl, first step excluded;
- bytes per tier per step (all ranks, sent; the ledger) beside each tier's closed form from the techniques'
  papers (nanotron_ext.metrics.tier_bytes: side traffic such as the pipeline wire's TP all-gather or
  heterogeneous SparseLoCo's T_fixed rows is not in the forms), and the fraction of step time spent waiting
  on each tier's emulated links (the trainer's link_wait_fraction);
- validation loss against wall-clock (cumulative training step time: start-up and validation excluded),
  and the headline: wall-clock to reach the target validation loss (default: the reference run's final
  validation loss + 2%; `--reference`, default the uncompressed pipeline). A run that does not reach it
  says so ("not reached": its time is not averaged in).
- each run's compute check (bench/clock/compute_check.py): its ranks' CPU seconds priced on the model clock over
  its own links; a run whose compute the machine's load stretched (link / compute more than 25% off the
  preset's) is flagged in the notes.

    python -m nanotron_ext.bench.wan --preset internet-200m-50ms                  # the committed CPU result
    python -m nanotron_ext.bench.wan --preset internet-200m-50ms internet-80m --systems pipeline subspace_pipeline
    python -m nanotron_ext.bench.wan --dry-run                                    # resolve every run, train nothing
    python -m nanotron_ext.bench.wan --jobs 4 --seeds 1 2 3 --out a.json          # 4 runs at a time (16 cores)
    python -m nanotron_ext.bench.wan --merge a.json b.json --out ab.json          # pool the runs of results
    python -m nanotron_ext.bench.wan --preset internet-1g-cpu --calibration-from a.json --out b.json  # a's links
    python -m nanotron_ext.bench.wan --system three_tiers                         # dp=2 x tp=2 x pp=2 (8 processes)
    python -m nanotron_ext.bench.wan --systems sparseloco_dp4 sparseloco_dp4_churn # churn: 1 of 4 replicas down 20%

`three_tiers` runs examples/config_three_tiers.yaml (the composition of issue 17: fast TP, slow PP, slowest
DP links); while that file does not exist the system refuses with a message naming it. `dense_3d` runs the
same file as the plain 3D layout (full rank, Megatron TP, uncompressed stage link, DP all-reduce every step).
Three link speeds, the DP tier slower than the pipeline's (`--set` comes last, so it wins):

    python -m nanotron_ext.bench.wan --systems dense_3d three_tiers --reference dense_3d \
        --preset internet-200m-50ms --set parallelism.link.dp.preset=internet-80m

Anchors printed beside ours (bench.paper): ProtocolNanoGPT's step time uncompressed / subspace-compressed
over 200 Mbit/s and 50 ms per stage (100.5 / 19.9 s = 5.05x), and ResBM Table 3's 80 Mbit/s half-duplex
throughput gain of ResBM 128x over the uncompressed run (7837 / 609 = 12.9x) when `internet-80m` is measured.

Calibrated presets (bench/wan/presets.py) keep a real setting's communication / compute ratio on each
tier, scaled to this machine: one run per tier of the uncompressed system without link emulation measures
this machine's compute step and the tier's bytes, and the tier's link gets the bandwidth and latency that give
the real ratio. `protocolnanogpt-cpu` (ProtocolNanoGPT's measured 100.5 vs 19.9 s/step over 200 Mbit/s + 50 ms)
and `resbm-80m-cpu` (ResBM Table 3's 609 vs 7530 tok/s at 80 Mbit/s half duplex) scale the stage link (the DP
tier gets the same link); `internet-1g-cpu` (heterogeneous SparseLoCo's 512M over 1 Gbit/s stage and DP links),
`boost-nvlink-cpu` and `boost-pcie-cpu` (BOOST's 7B at TP 4 over NVLink 3 or PCIe 4.0) model each tier's
ratio from the paper-scale config and a stated GPU throughput. Over the plain `internet-200m-50ms` preset a
CPU step is compute-bound and every ratio is near 1. Only the direction of a ratio (> 1) is judged against a
paper; its size depends on that scaling.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench.clock import CLOCK_PRESETS
from nanotron_ext.bench.clock import note as compute_check_note
from nanotron_ext.bench.paper import evaluate
from nanotron_ext.bench.report import help_with_defaults, publish, read_saved, run_meta, script_parser
from nanotron_ext.bench.wan import runs as emulated
from nanotron_ext.bench.wan.args import check_numbers, check_runs, saved_calibration, saved_rows
from nanotron_ext.bench.wan.losses import loss_runs
from nanotron_ext.bench.wan.modelled import measure_model, publish_model
from nanotron_ext.bench.wan.presets import ANCHORS
from nanotron_ext.bench.wan.results import CLAIMS, figure, headline, merged_runs, pooled_rows, table
from nanotron_ext.bench.wan.systems import BASE, DEFAULT_SYSTEMS, REPO, SYSTEMS, run_overrides, system_config
from nanotron_ext.cli_flags import one_line_refusals


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    from nanotron_ext.cli_flags import CONFIG, SEED, Float, InputFile, Int, KeyValue, OutputFolder
    from nanotron_ext.parallel.link import LINK_PRESETS

    p = script_parser(__doc__, "runs/wan/result.json")
    p.add_argument("--preset", nargs="+", default=["internet-200m-50ms"], choices=[*LINK_PRESETS, *ANCHORS],
                   help="link preset(s) of the pipeline and DP tiers; one row per system per preset ("
                        f"{', '.join(ANCHORS)}: a paper's link scaled to this machine's compute, calibrated first)")
    p.add_argument("--calibration-steps", type=Int(1), default=8, help="steps of the anchors' calibration run")
    p.add_argument("--calibration-from", metavar="JSON", type=InputFile(format="json"),
                   help="reuse the links an earlier result of this meter calibrated (its meta's anchor_calibration) "
                        "instead of calibrating again: runs added to that result get the same links, so --merge "
                        "pools like with like")
    p.add_argument("--tp-preset", default="nvlink", choices=list(LINK_PRESETS), help="the TP group's link preset")
    p.add_argument("--systems", "--system", nargs="+", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS),
                   help=f"systems to meter (known: {', '.join(SYSTEMS)})")
    p.add_argument("--reference", choices=list(SYSTEMS),
                   help="the system whose final validation loss sets the target, one of --systems "
                   "(default: pipeline; without it among --systems there is no target)")
    p.add_argument("--target-rel", type=Float(-1.0, low_open=True), default=0.02,  # the target must stay > 0
                   help="target = reference final validation loss x (1 + this)")
    p.add_argument("--config", default=BASE, type=CONFIG,
                   help="model, data and budget every system shares")
    p.add_argument("--steps", type=Int(1), default=60, help="training steps (the same token budget for every system)")
    p.add_argument("--val-every", type=Int(1), default=10,
                   help="validation interval in steps (the loss-vs-time points)")
    p.add_argument("--inner-steps", type=Int(1), default=10, help="SparseLoCo's inner steps H between outer syncs")
    p.add_argument("--seeds", type=SEED, nargs="+", default=[1, 2], help="one run per seed per system")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="extra override for every run")
    p.add_argument("--runs", default="runs/wan", type=OutputFolder(), help="where the runs' folders go")
    p.add_argument("--timeout-s", type=Float(0.0, low_open=True), default=1800, help="per run")
    p.add_argument("--reuse", action="store_true",
                   help="read a finished run of the same resolved config instead of training")
    p.add_argument("--dry-run", action="store_true", help="resolve and print every run's config, train nothing")
    p.add_argument("--jobs", type=Int(1), default=1,
                   help="runs trained side by side (emulated link waits are sleeps; keep jobs x processes per run "
                        "within the cores, or the step times include the runs' contention)")
    p.add_argument("--clock", choices=["emulated", "model"], default="emulated",
                   help="emulated: every system trained in its real layout over emulated links, its step times "
                        "measured (real sleeps; --preset); model: losses from each system's cheapest equivalent "
                        "layout, step times replayed on the model clock at each --clock-preset's scale and hardware")
    p.add_argument("--clock-preset", nargs="+", default=list(CLOCK_PRESETS), choices=list(CLOCK_PRESETS),
                   help="--clock model: the hardware, links and placement to time on (bench/clock/hardware.py)")
    p.add_argument("--equal-time", nargs="+", default=[], metavar="SYSTEM", choices=list(SYSTEMS),
                   help="--clock model: also train these systems for the reference's time to target on each "
                        "preset's clock (full overlap) at their own step time, their schedule over that length")
    p.add_argument("--max-steps", type=Int(1), default=4000, help="--equal-time: at most this many steps per run")
    p.add_argument("--equal-time-seeds", type=SEED, nargs="+", metavar="SEED",
                   help="--equal-time: the seeds of those runs (default: every --seeds)")
    p.add_argument("--validate-clock", action="store_true",
                   help="time each of --systems twice (no links, then emulated over --preset, one run at a time) "
                        "and hold the model clock's bounds to the emulated step (bench/wan/validate.py)")
    p.add_argument("--merge", nargs="+", metavar="JSON", type=InputFile(format="json"),
                   help="measure nothing: pool the per-seed runs of several results of this meter (e.g. systems "
                        "measured on different machines, same --steps, --reference and --target-rel) into --out")
    args = help_with_defaults(p).parse_args(argv)
    args.reference_given, args.reference = args.reference is not None, args.reference or "pipeline"
    return args


def planned_runs(args: argparse.Namespace) -> Dict[str, Tuple[Path, List[str]]]:
    """{name: (config, overrides)} of every run the meter trains (the anchors' links unscaled until calibrated)."""
    return {f"{p} {s} seed {seed}": (system_config(s, args), run_overrides(s, p, seed, args))
            for p in args.preset for s in args.systems for seed in args.seeds}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.errors import UserFacingError, one_line

    args = parse_args(argv)
    try:  # every argument checked before anything is trained or written (--out when parsed: bench.report)
        if args.from_json:
            saved = read_saved(args.from_json)
            kind = saved.get("meta", {}).get("clock") if isinstance(saved.get("meta"), dict) else None
            if kind == "model":
                return publish_model(args.out, saved["rows"], saved["meta"], saved.get("runs", []))
            if kind == "validation":
                return publish_validation(args.out, saved["rows"], saved["meta"])
            rows, meta = saved_rows(args.from_json, saved)
            return publish_result(args, rows, meta, saved.get("runs", []))
        if args.merge:
            runs, meta = merged_runs(args.merge)
            return publish_result(args, pooled_rows(runs, meta["reference"], meta["target_rel"]), meta, runs)
        missing = [s for s in args.systems if SYSTEMS[s].config and not (REPO / SYSTEMS[s].config).exists()]
        if missing:
            print(f"--system {missing[0]} needs {SYSTEMS[missing[0]].config} (issue 17's dp=2 x tp=2 x pp=2 "
                  "composition), which this checkout does not have", file=sys.stderr)
            return 2
        check_numbers(args)
        check_clock_args(args)
        if args.calibration_from:  # the dry run then shows the links the runs will get
            args.calibration = saved_calibration(args.calibration_from, args.preset)
            args.anchor_links = emulated.links_of(args.calibration)
        runs = loss_plan(args) if args.clock == "model" and not args.validate_clock else planned_runs(args)
        check_runs(runs, args.set)
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    if args.dry_run:
        from nanotron_ext.bench.presets import dry_run

        return dry_run(runs)
    if args.validate_clock:
        from nanotron_ext.bench.report import run_meta
        from nanotron_ext.bench.wan.validate import validate_system

        rows = [validate_system(system, preset, args) for preset in args.preset for system in args.systems]
        return publish_validation(args.out, rows, run_meta({"clock": "validation", "steps": args.steps,
                                                            "inner_steps": args.inner_steps, "seeds": args.seeds}))
    if args.clock == "model":
        rows, meta, curves = measure_model(args)
        return publish_model(args.out, rows, meta, curves)
    rows, meta, runs = measure(args)
    return publish_result(args, rows, meta, runs)


def check_clock_args(args: argparse.Namespace) -> None:
    """--equal-time and --max-steps: systems among --systems (their clocks are computed), a positive cap."""
    from nanotron_ext.cli_checks import ArgumentError

    args.equal_time_seeds = args.equal_time_seeds or args.seeds
    if any(seed not in args.seeds for seed in args.equal_time_seeds):
        raise ArgumentError(f"--equal-time-seeds {' '.join(map(str, args.equal_time_seeds))}: each must be among "
                            f"--seeds {' '.join(map(str, args.seeds))}")
    stray = [s for s in args.equal_time if s not in args.systems]
    if stray:
        raise ArgumentError(f"--equal-time {stray[0]} is not among --systems: its step time is not modelled")
    if args.equal_time and args.clock != "model":
        raise ArgumentError("--equal-time needs --clock model (the budget is a time on the model clock)")


def loss_plan(args: argparse.Namespace) -> Dict[str, Tuple[Path, List[str]]]:
    """{name: (config, overrides)} of every loss run of `--clock model` (its cheapest equivalent layout)."""
    return {f"{r.system} seed {r.seed} ({r.replicas} replica(s), {r.mode})": (Path(r.config_file), list(r.overrides))
            for r in loss_runs(args.systems, args.seeds, args)}


def publish_validation(out: str, rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> int:
    from nanotron_ext.bench.wan.validate import TITLE, notes, table

    headers, body = table(rows)
    publish(out, rows, meta, TITLE, headers, body, (), None, notes(rows))
    return 0


def measure(args: argparse.Namespace) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[Dict[str, Any]]]:
    """Every run trained and read (`--jobs` at a time); the pooled rows, the result's meta and the runs."""
    from tqdm import tqdm

    extra: Dict[str, Any] = {}
    if set(ANCHORS) & set(args.preset):
        extra["anchor_calibration"] = getattr(args, "calibration", None) or emulated.calibrate_anchors(args)
        args.anchor_links = emulated.links_of(extra["anchor_calibration"])
        print(f"anchor calibration: {extra['anchor_calibration']}")
    jobs = [(p, s, seed) for p in args.preset for s in args.systems for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own launch: threads only wait
        futures = [pool.submit(emulated.measure_run, s, p, seed, args) for p, s, seed in jobs]
        for _ in tqdm(as_completed(futures), total=len(futures), desc="wan meter runs", unit="run"):
            pass
        failed = [(job, f.exception()) for job, f in zip(jobs, futures) if f.exception() is not None]
        if failed:  # the finished runs stay in their folders: --reuse reads them back instead of training again
            for (preset, system, seed), error in failed:
                print(f"run {preset} {system} seed {seed} failed: {error!r}", file=sys.stderr)
            raise SystemExit(f"{len(failed)} of {len(jobs)} runs failed; every finished run is kept under --runs "
                             f"{args.runs}: the same command with --reuse reads them instead of training them again")
        runs = [f.result() for f in futures]  # in job order, whichever finished first
    rows = pooled_rows(runs, args.reference, args.target_rel)
    meta = run_meta({"presets": args.preset, "tp_preset": args.tp_preset, "steps": args.steps, "jobs": args.jobs,
                     "config": args.config, "reference": args.reference, "target_rel": args.target_rel,
                     "set": args.set, "own_configs": {s: SYSTEMS[s].config for s in args.systems if SYSTEMS[s].config},
                     "note": "step times measured on a shared, loaded machine unless stated otherwise",
                     # --reuse read finished runs back: their step times are of when they trained, not of this load
                     "reused_runs": bool(args.reuse), **extra})
    return rows, meta, runs


def publish_result(args: argparse.Namespace, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any],
                   runs: Sequence[Mapping[str, Any]] = ()) -> int:
    title = "Wall-clock to a target validation loss over one emulated link preset"
    headers, body = table(rows)
    notes = [*headline(rows),
             "Wall-clock = summed training step time (start-up and validation excluded); target = the reference "
             f"run's final validation loss x {1 + meta.get('target_rel', 0.02):g}. Step times: {meta.get('note', '')}.",
             *([compute_check_note(runs)] if runs else [])]
    claims = [c for c in CLAIMS if any(c.matches(r) for r in rows)]  # the anchors of the presets measured
    publish(args.out, rows, meta, title, headers, body, evaluate(claims, rows), figure(rows), notes,
            extra={"runs": list(runs)} if runs else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
