"""CPU-scale comparison for Subspace Models (paper "Protocol Models: Scaling Decentralized Training with
Communication-Efficient Model Parallelism", Table 1 and the lossy-baselines figure of sec. 8.7, scaled down):
the same tiny Llama over PP=2 on the embedded corpus, trained for the same number of steps as

    centralised      uncompressed, emulated 10 Gbit/s link
    decentralised    uncompressed, emulated slow link (--mbps, default 10 Mbit/s: see SLOW)
    sm               subspace codec (W = U W_small, k = d/8), slow link
    sm_projection_modadamw_grassmann   full weights + sec. 5 AdamW + Grassmann every 50 steps, slow link
    sm_projection / sm_projection_modadamw / sm_grassmann   the ablations one at a time: full weights
                   re-projected after every plain AdamW step; the same with the sec. 5 AdamW; W = U W_small
                   with Grassmann updates every 50 steps
    topk / int4 / lowrank   lossy baselines at about the same ratio (8x), slow link

    .venv/bin/python reproduce/sm/cpu_compare.py [--steps 200] [--rows sm,topk] [--seed 43]
    .venv/bin/python reproduce/sm/cpu_compare.py --from-json reproduce/sm/results/cpu_table1.json
    .venv/bin/python reproduce/sm/cpu_compare.py --preset gpu --data /data/owt/jsonl --seeds 42 43 --dry-run

Each row runs `torchrun --standalone --nproc_per_node 2 -m nanotron_ext.train` on
examples/config_tiny_llama.yaml with the overrides below; runs go to runs/sm/<row>/. Rows are added to
the result named by --out (default runs/sm/cpu_compare.json; an earlier result there is kept and
extended, --seed N stores rows under "seeds"): final train / validation loss, perplexity, tokens/s,
pipeline bytes per step, wall time, the paper's numbers beside; the PNG shows train loss vs step and vs
wall-clock time. Orderings are judged on the seeds a row has (one seed: undetermined).
GPU preset: the 2B sm_2b_{centralised,compressed}.yaml on one 80 GB GPU at equal steps (pp = 1, the
codec after every block but the last; no emulated link: time-to-loss needs the 8-GPU PP = 8 runs of
those files' headers). Needs the data: python -m nanotron_ext.data prepare --config-file
examples/config_tiny_llama.yaml
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanotron_ext.bench import presets  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench.paper import PaperClaim, evaluate  # noqa: E402
from nanotron_ext.cli_flags import SEED, Float, Int, Names, one_line_refusals  # noqa: E402

BASE = ["parallelism.dp=1", "parallelism.pp=2", "model.tie_embeddings=false", "tokens.sequence_length=128",
        "tokens.micro_batch_size=8", "tokens.batch_accumulation_per_replica=2", "tokens.val_check_interval=50",
        "tokens.val_steps=8", "checkpoints.interval=0", "checkpoints.resume=overwrite", "logging.progress_bar=false",
        "parallelism.link.enabled=true", "general.output_dir=runs/sm"]
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
      "model.subspace.k=16"]
# The slow link: the paper's 80 Mbit/s makes its 2B pipeline link-bound (36 vs 603 tokens/s); this tiny
# model computes ~1000x less per token, so the same balance needs a slower link (--mbps, default 10).
SLOW = "parallelism.link.bandwidth_mbps={mbps}"
ROWS: Dict[str, List[str]] = {
    "centralised": ["parallelism.link.bandwidth_mbps=10000"],
    "decentralised": [SLOW],
    "sm": SM + [SLOW],
    "sm_projection_modadamw_grassmann": SM + ["model.subspace.parameterisation=projection",
                                              "model.subspace.modified_adamw=true", "model.subspace.grassmann_every=50",
                                              SLOW],
    "sm_projection": SM + ["model.subspace.parameterisation=projection", SLOW],
    "sm_projection_modadamw": SM + ["model.subspace.parameterisation=projection", "model.subspace.modified_adamw=true",
                                    SLOW],
    "sm_grassmann": SM + ["model.subspace.grassmann_every=50", SLOW],
    "topk": ["model.codec.kind=topk", "model.codec.ratio=8", SLOW],
    "int4": ["model.codec.kind=int4", SLOW],
    "lowrank": ["model.codec.kind=lowrank", "model.codec.ratio=8", SLOW],
}
# Table 1 of the paper (8 layers, 2B, A10G pipeline): perplexity on OWT / BookCorpus / WikiText, tokens/s
PAPER_TABLE1 = {
    "decentralised": {"bandwidth": "80 Mbit/s", "ppl_owt": 925.19, "ppl_bc": 108.85, "ppl_wt": 601.84, "tps": 36.12},
    "sm": {"bandwidth": "80 Mbit/s", "ppl_owt": 46.75, "ppl_bc": 17.63, "ppl_wt": 23.01, "tps": 592.41},
    "centralised": {"bandwidth": "100 Gbit/s", "ppl_owt": 47.22, "ppl_bc": 18.35, "ppl_wt": 23.08, "tps": 602.57},
}


def run_row(name: str, steps: int, nproc: int, mbps: float, seed: Optional[int] = None) -> Dict[str, object]:
    """One row; with `seed`, the run (general.seed = seed) is named <name>_seed<seed>."""
    run = name if seed is None else f"{name}_seed{seed}"
    sets = BASE + [o.format(mbps=mbps) for o in ROWS[name]] + [f"general.run={run}", f"tokens.train_steps={steps}",
                                                               f"checkpoints.dir=runs/sm/ckpt_{run}"]
    sets += [] if seed is None else [f"general.seed={seed}"]
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "nanotron_ext.train",
           "--config-file", "examples/config_tiny_llama.yaml"] + [a for s in sets for a in ("--set", s)]
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd[0] = str(torchrun)
    t0 = datetime.datetime.now()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run_dir = ROOT / "runs" / "sm" / run
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    wall, curve = 0.0, []
    for m in metrics:
        wall += m.get("step_time_s", 0.0)
        curve.append({"step": m["step"], "loss": m["loss"], "wall_s": wall,
                      **({"val_loss": m["val_loss"]} if "val_loss" in m else {})})
    return {"overrides": [o.format(mbps=mbps) for o in ROWS[name]], "summary": summary, "curve": curve,
            "train_wall_s": wall,
            "elapsed_s": (datetime.datetime.now() - t0).total_seconds()}


def figure(results: Dict[str, Dict[str, Any]]) -> Any:
    fig, axes = br.new_figure(2, width=5.5, height=4)
    for name, r in results.items():
        c = r["curve"]
        axes[0].plot([p["step"] for p in c], [p["loss"] for p in c], label=name, lw=1)
        axes[1].plot([p["wall_s"] for p in c], [p["loss"] for p in c], label=name, lw=1)
    axes[0].set(xlabel="optimiser step", ylabel="train loss", title="same steps")
    axes[1].set(xlabel="wall-clock training time (s, emulated links)", ylabel="train loss", title="same time")
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def as_table(saved: Dict[str, Any]) -> Dict[str, Any]:
    """A saved result with its rows keyed by name (published results list them)."""
    rows = saved.get("rows", {})
    if isinstance(rows, list):
        saved = {**saved, "rows": {r["name"]: {k: v for k, v in r.items() if k != "name"} for r in rows}}
    return saved


def _table_to_extend(out: Path) -> Dict[str, Any]:
    """The saved table the new rows join, checked (a result this script wrote, every number finite): a damaged one
    is refused naming --out (was a traceback, or its NaN in the table)."""
    from nanotron_ext.cli_checks import ArgumentError
    from nanotron_ext.plan.cached import first_non_finite

    advice = "move it away to run every row again"
    try:
        table = as_table(br.read_saved(out, "--out"))
    except (KeyError, TypeError):  # a row without its name
        raise ArgumentError(f"--out {out}: rows are not this script's (objects with their name); {advice}") from None
    bad = first_non_finite(table, "")
    if bad:
        raise ArgumentError(f"--out {out}: {bad}, not a finite number; {advice}")
    return table


def val_losses(table: Dict[str, Any]) -> Dict[str, Dict[int, float]]:
    """Final validation loss per row and seed (the main rows ran with the config's seed, 42)."""
    out = {n: {42: r["summary"]["final_val_loss"]} for n, r in table["rows"].items()}
    for n, seeds in table.get("seeds", {}).items():
        for seed, summary in seeds.items():
            out.setdefault(n, {})[int(seed)] = summary["final_val_loss"]
    return out


def comparisons(table: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Paired (same seed) validation-loss differences the paper's claims are about, mean +- s.e."""
    v = val_losses(table)
    out = []
    for row, than in (("sm", "centralised"), ("topk", "sm"), ("int4", "sm"), ("lowrank", "sm"),
                      ("sm_projection", "sm"), ("sm_projection_modadamw", "sm"), ("sm_grassmann", "sm")):
        diffs = [v[row][s] - v[than][s] for s in sorted(v.get(row, {})) if s in v.get(than, {})]
        if diffs:
            err = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
            out.append({"key": f"{row} - {than}", "value": statistics.fmean(diffs), "err": err, "n": len(diffs)})
    return out


# ln(ppl SM / ppl centralised) on OpenWebText, Table 1: 46.75 vs 47.22
CLAIMS = [
    PaperClaim("SM minus uncompressed, validation loss at equal steps (paper: parity or better)", "value",
               -0.0100, "<=", 0.0, where={"key": "sm - centralised"}, err_column="err", source="Table 1",
               setting="2B, 8 layers, OWT (ln of the perplexity ratio)"),
    *[PaperClaim(f"{lossy} minus SM, validation loss (lossy baselines fail at aggressive ratios)",
                 "value", None, ">", 0.0,
                 where={"key": f"{lossy} - sm"}, err_column="err", source="sec. 8.7 (Fig. 6)")
      for lossy in ("topk", "int4", "lowrank")],
    *[PaperClaim(f"{row} minus SM (W = U W_small), validation loss (no paper number)", "value", None, None,
                 where={"key": f"{row} - sm"}, err_column="err", source="ablation")
      for row in ("sm_projection", "sm_projection_modadamw", "sm_grassmann")],
]


def render(table: Dict[str, Any]) -> Dict[str, Any]:
    meta = table.get("meta") or {"machine": table.get("device"), "date": table.get("date"), "steps": table.get("steps"),
                                 "slow_link_mbps": table.get("slow_link_mbps")}
    v = val_losses(table)
    headers = ["row", "pp bytes/step", "final train loss", "val loss (seed 42)", "val ppl", "tokens/s", "train wall s",
               "seeds: val loss mean +- s.e.", "paper ppl OWT / BC / WT (2B)"]
    body, rows = [], []
    for name, r in table["rows"].items():
        s = r["summary"]
        seeds = v.get(name, {})
        mean = statistics.fmean(seeds.values())
        se = statistics.stdev(seeds.values()) / len(seeds) ** 0.5 if len(seeds) > 1 else None
        paper = table.get("paper_table1", {}).get(name)
        body.append([name, f"{s['comm_bytes_per_step'].get('pp', 0):,}", f"{s['final_train_loss']:.3f}",
                     f"{s['final_val_loss']:.3f}", f"{s['final_val_ppl']:.1f}", f"{s['tokens_per_s']:.0f}",
                     f"{r['train_wall_s']:.0f}", f"{mean:.3f}" + ("" if se is None else f" +- {se:.3f} ({len(seeds)})"),
                     "-" if not paper else f"{paper['ppl_owt']} / {paper['ppl_bc']} / {paper['ppl_wt']}"])
        rows.append({"name": name, **r})
    comps = comparisons(table)
    extra = {k: table[k] for k in ("seeds", "base_overrides", "paper_table1") if k in table}
    return {"rows": rows, "meta": meta, "body": body, "headers": headers, "verdicts": evaluate(CLAIMS, comps),
            "figure": figure(table["rows"]), "extra": {**extra, "comparisons": comps}}


def gpu_runs(args: argparse.Namespace) -> Dict[str, Any]:
    """The 2B rows on one GPU at equal steps: pp = 1, no emulated link, the codec after every block but the last."""
    common = presets.gpu_overrides(args) + ["parallelism.pp=1", "parallelism.link.enabled=false"]
    return {"centralised": ("reproduce/sm/sm_2b_centralised.yaml", common),
            "sm": ("reproduce/sm/sm_2b_compressed.yaml", common + ["model.codec.boundaries=every_layer"])}


def gpu_table(args: argparse.Namespace) -> Dict[str, Any]:
    """Train the GPU rows once per seed (seed 42 or the first: the main rows; others under 'seeds')."""
    from nanotron_ext.bench.training import run_training

    table: Dict[str, Any] = {"rows": {}, "seeds": {}}
    for i, seed in enumerate(args.seeds):
        for name, (config, overrides) in gpu_runs(args).items():
            s = run_training(config, presets.with_seed(overrides, seed), f"sm_gpu_{name}_s{seed}",
                             root=Path("runs/sm_gpu"))
            if i == 0:
                curve = [{"step": st, "loss": loss, "wall_s": 0.0} for st, loss in s["val_curve"]]
                table["rows"][name] = {"overrides": overrides, "summary": s, "curve": curve, "train_wall_s": 0.0}
            else:
                table["seeds"].setdefault(name, {})[str(seed)] = s
    table["meta"] = br.run_meta({"steps": "config", "slow_link_mbps": None, "preset": "gpu", "seeds": args.seeds})
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = br.script_parser(__doc__, "runs/sm/cpu_compare.json")
    parser.add_argument("--steps", type=Int(1), default=200, help="training steps per row")
    parser.add_argument("--rows", default=",".join(ROWS), type=Names(tuple(ROWS)),
                        help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--nproc", type=Int(1), default=2, help="processes per run (PP = 2)")
    parser.add_argument("--mbps", type=Float(0.0, low_open=True), default=10.0,
                        help="slow-link bandwidth (Mbit/s) of the non-centralised rows")
    parser.add_argument("--seed", type=SEED, default=None,
                        help="another general.seed: rows are stored under 'seeds' (the main table "
                             "keeps the config's seed)")
    presets.add_preset_args(parser, "the 2B sm_2b_{centralised,compressed}.yaml rows on one 80 GB GPU at equal steps "
                                    "(bf16, pp = 1, no emulated link; the curve is the validation loss)")
    return br.help_with_defaults(parser)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        table = as_table(br.read_saved(args.from_json))
    elif args.preset == "gpu":
        if args.dry_run:
            return presets.dry_run(presets.runs_for_seeds(gpu_runs(args), args.seeds))
        table = gpu_table(args)
    else:
        out = Path(args.out)
        table = _table_to_extend(out) if out.exists() else {"rows": {}}
        for name in args.rows.split(","):
            print(f"== {name}", flush=True)
            row = run_row(name, args.steps, args.nproc, args.mbps, args.seed)
            if args.seed is None:
                table["rows"][name] = row
            else:  # only the summary: the main table and its plot keep the config's seed
                table.setdefault("seeds", {}).setdefault(name, {})[str(args.seed)] = row["summary"]
        table["meta"] = br.run_meta({"steps": args.steps, "slow_link_mbps": args.mbps})
        table.update({"base_overrides": BASE, "paper_table1": PAPER_TABLE1})
    r = render(table)
    title = (f"Subspace Models Table 1 / sec. 8.7 at CPU scale (PP = 2, d = 128, k = 16; slow link "
             f"{r['meta'].get('slow_link_mbps')} Mbit/s, {r['meta'].get('steps')} steps)")
    br.publish(args.out, r["rows"], r["meta"], title, r["headers"], r["body"], r["verdicts"], r["figure"],
               extra=r["extra"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
