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

Calibrated presets (bench/wan_anchors.py) keep a real setting's communication / compute ratio on each
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
import dataclasses
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench.paper import PaperClaim, evaluate, mean_se
from nanotron_ext.bench.report import (
    help_with_defaults,
    publish,
    read_saved,
    run_meta,
    script_parser,
)
from nanotron_ext.bench.wan_anchors import (
    ANCHOR,
    ANCHORS,
    CALIBRATION_SYSTEM,
    describe,
    scaled_link,
    tier_links,
    tier_seconds_at_1mbps,
)
from nanotron_ext.bench.wan_args import check_numbers, check_runs, config_file, saved_calibration, saved_rows
from nanotron_ext.bench.wan_results import (
    TIERS,
    figure,
    headline,
    loss_by,
    merged_runs,
    run_curve,
    table,
    time_to_target,
)

REPO = Path(__file__).resolve().parents[2]
BASE = "reproduce/wan/cpu_base.yaml"
THREE_TIERS = "examples/config_three_tiers.yaml"
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
      "model.subspace.k=16"]


@dataclasses.dataclass(frozen=True)
class System:
    """One row of the meter: how it is launched (processes, config keys) and which tiers its traffic crosses."""

    label: str
    nproc: int
    overrides: Tuple[str, ...]
    config: Optional[str] = None  # its own YAML instead of --config (the three-tier composition)


PIPE = ("parallelism.pp=2", "parallelism.dp=1", "tokens.batch_accumulation_per_replica=4")
DATA = ("parallelism.pp=1", "parallelism.dp=2", "tokens.batch_accumulation_per_replica=2")
DATA4 = ("parallelism.pp=1", "parallelism.dp=4", "tokens.batch_accumulation_per_replica=1")
TP2 = ("parallelism.pp=1", "parallelism.dp=1", "parallelism.tp=2", "tokens.batch_accumulation_per_replica=4")
LOW_RANK = ("model.low_rank.kind=svd", "model.low_rank.rank=32")  # d/4 at cpu_base.yaml's d = 128
SYSTEMS: Dict[str, System] = {
    "pipeline": System("uncompressed pipeline (pp=2)", 2, PIPE),
    "subspace_pipeline": System("SM subspace codec k=d/8 (pp=2)", 2, PIPE + tuple(SM)),
    "resbm_pipeline": System("ResBM 128x (pp=2)", 2, PIPE + ("model.codec.kind=resbm", "model.codec.resbm.h=1")),
    "ddp": System("DP all-reduce every step (dp=2)", 2, DATA),
    "sparseloco": System("SparseLoCo (dp=2; --inner-steps)", 2, DATA + ("parallelism.dp_sync=sparseloco",)),
    # opt-in rows (not in DEFAULT_SYSTEMS; resolved by tests/test_wan_meter.py, not yet in a committed result)
    "topk_pipeline": System("lossy top-k 8x (pp=2)", 2, PIPE + ("model.codec.kind=topk", "model.codec.ratio=8")),
    "int4_pipeline": System("lossy int4 (pp=2)", 2, PIPE + ("model.codec.kind=int4",)),
    "lowrank_pipeline": System("lossy low-rank 8x (pp=2)", 2,
                               PIPE + ("model.codec.kind=lowrank", "model.codec.ratio=8")),
    "mapl_pipeline": System("MAPL (pp=2)", 2, PIPE + ("model.codec.kind=mapl",)),
    "mapl_vq_pipeline": System("MAPL + VQ (pp=2)", 2, PIPE + ("model.codec.kind=mapl", "model.codec.mapl.vq_groups=32",
                                                             "model.codec.mapl.vq_rounds=2",
                                                             "model.codec.mapl.vq_codebook=16")),
    "het_sparseloco": System("heterogeneous SparseLoCo, replica 0 subspace-compressed (dp=2 x pp=2)", 4,
                             ("parallelism.pp=2", "parallelism.dp=2", "tokens.batch_accumulation_per_replica=2",
                              "parallelism.dp_sync=sparseloco", "sparseloco.compressed_replicas=[0]",
                              "model.subspace.k=16")),
    # BOOST: BTP inside each stage (tp=2 on --tp-preset) of a low-rank (SVD, rank d/4) model, its sharded wire
    # across the stage link as is; beside it, the same low-rank model without TP
    "svd_pipeline": System("SVD low-rank r=d/4 (pp=2)", 2, PIPE + LOW_RANK),
    "btp_pipeline": System("BOOST BTP, SVD low-rank r=d/4 (tp=2 x pp=2)", 4,
                           PIPE + LOW_RANK + ("parallelism.tp=2", "model.tp_strategy=btp")),
    # Megatron TP of the dense model (tp=2): the TP tier's uncompressed traffic (the calibrated presets measure it);
    # BOOST's comparison on the same TP layout: the low-rank model under vanilla TP and under BTP
    "megatron_tp": System("Megatron TP (tp=2)", 2, TP2 + ("model.tp_strategy=megatron",)),
    "vanilla_tp": System("vanilla TP, SVD low-rank r=d/4 (tp=2)", 2, TP2 + LOW_RANK + ("model.tp_strategy=vanilla",)),
    "btp_tp": System("BOOST BTP, SVD low-rank r=d/4 (tp=2)", 2, TP2 + LOW_RANK + ("model.tp_strategy=btp",)),
    "three_tiers": System("three tiers dp=2 x tp=2 x pp=2 (issue 17)", 8, (), config=THREE_TIERS),
    # the same job as a plain 3D layout: full rank, Megatron TP, uncompressed stage link, DP all-reduce every step
    "dense_3d": System("uncompressed 3D dp=2 x tp=2 x pp=2 (Megatron, identity, all-reduce)", 8,
                       ("model.low_rank.kind=none", "model.tp_strategy=megatron", "parallelism.dp_sync=allreduce",
                        "sparseloco=null"), config=THREE_TIERS),
    # the churn scenario: 4 replicas, one of them absent from 1 outer sync in 5 (sparseloco.churn), beside no churn
    "sparseloco_dp4": System("SparseLoCo (dp=4)", 4, DATA4 + ("parallelism.dp_sync=sparseloco",)),
    "sparseloco_dp4_churn": System("SparseLoCo (dp=4), one replica down 20% of syncs", 4,
                                   DATA4 + ("parallelism.dp_sync=sparseloco", "sparseloco.churn.down_syncs=1",
                                            "sparseloco.churn.period=5")),
}
DEFAULT_SYSTEMS = ["pipeline", "subspace_pipeline", "ddp", "sparseloco"]


CLAIMS = [
    PaperClaim("step time uncompressed / subspace-compressed pipeline", "step_time_ratio_vs_pipeline", 5.05,
               ">", 1.0, where={"system": "subspace_pipeline", "preset": ANCHOR},
               err_column="step_time_ratio_vs_pipeline_se", source="ProtocolNanoGPT",
               setting="200 Mbit/s + 50 ms per stage, 100.5 vs 19.9 s/step; ours: its compute:comm ratio scaled"),
    PaperClaim("step time uncompressed / subspace pipeline, unscaled link (CPU compute-bound: value only)",
               "step_time_ratio_vs_pipeline", 5.05, None, where={"system": "subspace_pipeline",
                                                                 "preset": "internet-200m-50ms"},
               err_column="step_time_ratio_vs_pipeline_se", source="ProtocolNanoGPT",
               setting="200 Mbit/s + 50 ms per stage, 100.5 vs 19.9 s/step; ours: the same link, our compute"),
    PaperClaim("step time uncompressed / ResBM 128x pipeline (throughput gain)", "step_time_ratio_vs_pipeline",
               7837 / 609, ">", 1.0, where={"system": "resbm_pipeline", "preset": "resbm-80m-cpu"},
               err_column="step_time_ratio_vs_pipeline_se", source="ResBM Table 3",
               setting="80 Mbit/s half duplex, 609 vs 7837 tok/s (AdamW 128x); ours: its compute:comm ratio scaled"),
]


# -- reading one run ------------------------------------------------------------------------------------------
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
            "link_wait_fraction": summary.get("link_wait_fraction", {}), "final_val_loss": summary["final_val_loss"]}


def closed_forms(system: str, preset: str, seed: int, args: argparse.Namespace) -> Dict[str, Optional[float]]:
    """Each tier's bytes per step by closed form, all ranks (nanotron_ext.metrics.tier_bytes), for one run's
    config: what the ledger column should read, up to the side traffic the forms leave out."""
    from nanotron_ext.config import load_config
    from nanotron_ext.metrics.tier_bytes import job_bytes_per_step

    forms = job_bytes_per_step(load_config(system_config(system, args), run_overrides(system, preset, seed, args)))
    return {t: forms.get(t, 0.0) for t in TIERS}


def uses_outer_loop(s: System) -> bool:
    """Whether a system's replicas sync by SparseLoCo's outer loop (its keys, or its own YAML unless overridden)."""
    if "parallelism.dp_sync=sparseloco" in s.overrides:
        return True
    return s.config == THREE_TIERS and "parallelism.dp_sync=allreduce" not in s.overrides


def shared_warmup(args: argparse.Namespace) -> int:
    """The warm-up steps of --config (what the systems built on it train with)."""
    from nanotron_ext.config import load_config

    return load_config(config_file("--config", args.config, REPO), []).optimizer.warmup_steps


def system_config(system: str, args: argparse.Namespace) -> Path:
    """The YAML a system's runs start from: its own file of the checkout, else --config (found from any folder)."""
    s = SYSTEMS[system]
    return REPO / s.config if s.config else config_file("--config", args.config, REPO)


def run_overrides(system: str, preset: str, seed: int, args: argparse.Namespace) -> List[str]:
    """The keys one run sets: the system's, the link preset on every tier, the budget and the seed."""
    s = SYSTEMS[system]
    if preset in ANCHORS:  # a calibrated preset: each tier scaled to this machine (bench/wan_anchors.py)
        link = tier_links(preset, getattr(args, "anchor_links", {}).get(preset), args.tp_preset)
    else:
        link = ["parallelism.link.enabled=true", f"parallelism.link.preset={preset}",
                f"parallelism.link.dp.preset={preset}", f"parallelism.link.tp.preset={args.tp_preset}"]
    # the same budget for every system, also those with their own YAML (the three-tier file's own 30 steps and 5
    # warm-up steps gave way to --steps and the shared config's warm-up)
    budget = [f"tokens.train_steps={args.steps}", f"tokens.val_check_interval={args.val_every}"]
    if s.config:
        budget.append(f"optimizer.warmup_steps={shared_warmup(args)}")
    if uses_outer_loop(s):
        budget.append(f"sparseloco.inner_steps={args.inner_steps}")
    return [*s.overrides, *link, *budget, f"general.seed={seed}", "logging.progress_bar=false", *args.set]


def calibrate_anchors(args: argparse.Namespace) -> Dict[str, Any]:
    """The calibrated presets' links scaled to this machine (bench/wan_anchors.py): one run without link
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


# -- rows: seeds pooled per (preset, system) ------------------------------------------------------------------
def pooled_rows(runs: Sequence[Mapping[str, Any]], reference: str, target_rel: float) -> List[Dict[str, Any]]:
    """One row per (preset, system): means and standard errors over seeds, time to the preset's target."""
    rows: List[Dict[str, Any]] = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        mine = [r for r in runs if r["preset"] == preset]
        ref = [r["final_val_loss"] for r in mine if r["system"] == reference and r["final_val_loss"] is not None]
        target = statistics.fmean(ref) * (1 + target_rel) if ref else None
        ref_step = statistics.fmean([r["steady_step_s"] for r in mine if r["system"] == reference] or [math.nan])
        # equal wall-clock: the shortest run's training time, where every run still has a measured loss
        common = min((r["val_vs_wall"][-1][0] for r in mine if r["val_vs_wall"]), default=None)
        for system in dict.fromkeys(r["system"] for r in mine):
            seeds = [r for r in mine if r["system"] == system]
            step, step_se = mean_se([r["steady_step_s"] for r in seeds])
            loss, loss_se = mean_se([r["final_val_loss"] for r in seeds])
            hits = [time_to_target(r["val_vs_wall"], target) for r in seeds] if target is not None else []
            reached = [h for h in hits if h is not None]
            ttt, ttt_se = mean_se(reached)
            ratios = [ref_step / r["steady_step_s"] for r in seeds]
            ratio, ratio_se = mean_se(ratios)
            waits = [r["link_wait_fraction"] for r in seeds if r["link_wait_fraction"]]
            at_common, at_common_se = mean_se([loss_by(r["val_vs_wall"], common) for r in seeds]
                                              if common is not None else [])
            rows.append({
                "preset": preset, "system": system, "label": SYSTEMS[system].label if system in SYSTEMS else system,
                "seeds": [r["seed"] for r in seeds], "steady_step_s": step, "steady_step_s_se": step_se,
                "step_time_ratio_vs_pipeline": ratio if math.isfinite(ratio) else None,
                "step_time_ratio_vs_pipeline_se": ratio_se,
                "bytes_per_step": {t: statistics.fmean(r["bytes_per_step"][t] for r in seeds) for t in TIERS},
                "closed_form_bytes_per_step": seeds[0].get("closed_form_bytes_per_step", {}),
                "link_wait_fraction": {t: statistics.fmean(w.get(t, 0.0) for w in waits)
                                       for t in TIERS} if waits else {},
                "final_val_loss": loss, "final_val_loss_se": loss_se, "target_val_loss": target,
                "common_wall_s": common, "val_loss_at_common_wall": at_common,
                "val_loss_at_common_wall_se": at_common_se,
                "time_to_target_s": ttt, "time_to_target_s_se": ttt_se, "reached": f"{len(reached)}/{len(seeds)}",
                "curves": [r["val_vs_wall"] for r in seeds],
            })
    return rows


# -- command line -----------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    from nanotron_ext.parallel.link import LINK_PRESETS

    p = script_parser(__doc__, "runs/wan/result.json")
    p.add_argument("--preset", nargs="+", default=["internet-200m-50ms"], choices=[*LINK_PRESETS, *ANCHORS],
                   help="link preset(s) of the pipeline and DP tiers; one row per system per preset ("
                        f"{', '.join(ANCHORS)}: a paper's link scaled to this machine's compute, calibrated first)")
    p.add_argument("--calibration-steps", type=int, default=8, help="steps of the anchors' calibration run")
    p.add_argument("--calibration-from", metavar="JSON",
                   help="reuse the links an earlier result of this meter calibrated (its meta's anchor_calibration) "
                        "instead of calibrating again: runs added to that result get the same links, so --merge "
                        "pools like with like")
    p.add_argument("--tp-preset", default="nvlink", choices=list(LINK_PRESETS), help="the TP group's link preset")
    p.add_argument("--systems", "--system", nargs="+", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS),
                   help=f"systems to meter (known: {', '.join(SYSTEMS)})")
    p.add_argument("--reference", help="the system whose final validation loss sets the target, one of --systems "
                   "(default: pipeline; without it among --systems there is no target)")
    p.add_argument("--target-rel", type=float, default=0.02,
                   help="target = reference final validation loss x (1 + this)")
    p.add_argument("--config", default=BASE, help="model, data and budget every system shares")
    p.add_argument("--steps", type=int, default=60, help="training steps (the same token budget for every system)")
    p.add_argument("--val-every", type=int, default=10, help="validation interval in steps (the loss-vs-time points)")
    p.add_argument("--inner-steps", type=int, default=10, help="SparseLoCo's inner steps H between outer syncs")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="one run per seed per system")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--runs", default="runs/wan", help="where the runs' folders go")
    p.add_argument("--timeout-s", type=float, default=1800, help="per run")
    p.add_argument("--reuse", action="store_true",
                   help="read a finished run of the same resolved config instead of training")
    p.add_argument("--dry-run", action="store_true", help="resolve and print every run's config, train nothing")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained side by side (emulated link waits are sleeps; keep jobs x processes per run "
                        "within the cores, or the step times include the runs' contention)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="measure nothing: pool the per-seed runs of several results of this meter (e.g. systems "
                        "measured on different machines, same --steps, --reference and --target-rel) into --out")
    args = help_with_defaults(p).parse_args(argv)
    args.reference_given, args.reference = args.reference is not None, args.reference or "pipeline"
    return args


def planned_runs(args: argparse.Namespace) -> Dict[str, Tuple[Path, List[str]]]:
    """{name: (config, overrides)} of every run the meter trains (the anchors' links unscaled until calibrated)."""
    return {f"{p} {s} seed {seed}": (system_config(s, args), run_overrides(s, p, seed, args))
            for p in args.preset for s in args.systems for seed in args.seeds}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.errors import UserFacingError

    args = parse_args(argv)
    try:  # every argument checked before anything is trained or written (--out when parsed: bench.report)
        if args.from_json:
            saved = read_saved(args.from_json)
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
        if args.calibration_from:  # the dry run then shows the links the runs will get
            args.calibration = saved_calibration(args.calibration_from, args.preset)
            args.anchor_links = links_of(args.calibration)
        runs = planned_runs(args)
        check_runs(runs, args.set)
    except UserFacingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from nanotron_ext.bench.presets import dry_run

        return dry_run(runs)
    rows, meta, runs = measure(args)
    return publish_result(args, rows, meta, runs)


def measure(args: argparse.Namespace) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[Dict[str, Any]]]:
    """Every run trained and read (`--jobs` at a time); the pooled rows, the result's meta and the runs."""
    from tqdm import tqdm

    extra: Dict[str, Any] = {}
    if set(ANCHORS) & set(args.preset):
        extra["anchor_calibration"] = getattr(args, "calibration", None) or calibrate_anchors(args)
        args.anchor_links = links_of(extra["anchor_calibration"])
        print(f"anchor calibration: {extra['anchor_calibration']}")
    jobs = [(p, s, seed) for p in args.preset for s in args.systems for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own launch: threads only wait
        futures = [pool.submit(measure_run, s, p, seed, args) for p, s, seed in jobs]
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
             f"run's final validation loss x {1 + meta.get('target_rel', 0.02):g}. Step times: {meta.get('note', '')}."]
    claims = [c for c in CLAIMS if any(c.matches(r) for r in rows)]  # the anchors of the presets measured
    publish(args.out, rows, meta, title, headers, body, evaluate(claims, rows), figure(rows), notes,
            extra={"runs": list(runs)} if runs else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
