"""Fig. 3 of "Protocol Models: Scaling Decentralized Training with Communication-Efficient Model Parallelism",
scaled down: does compression between every pair of blocks hurt more as the model gets deeper? The paper
trains 8- and 16-layer models with one block per GPU and finds SM on par with the centralised model at
both depths, and argues (Theorem B.1) that a lossy compressor's error grows with depth.

Here: the tiny Llama of examples/config_tiny_llama.yaml at --depths (default 4 and 8 layers), the codec after
every block but the last (model.codec.boundaries = every_layer: a pipeline of L stages on one process, so
the comparison is about convergence, not links), same steps and data for every row:

    uncompressed   no codec
    sm             subspace codec, k = d/8 (W = U W_small)
    int4 / lowrank / topk   lossy baselines at about the same ratio (as reproduce/sm/cpu_compare.py)

Reported per depth and seed (--seeds: initialisation and data order): final validation loss and its gap to
the uncompressed model of that depth and seed; then per row the mean over seeds of the gap's growth from
the shallowest to the deepest model, with its standard error. The paper's ordering: SM's gap stays small
at both depths; a lossy codec's gap grows with depth.

    .venv/bin/python reproduce/sm/fig3_depth.py --seeds 42 43 44       # writes runs/sm/fig3_depth.{json,md,png}
    .venv/bin/python reproduce/sm/fig3_depth.py --from-json reproduce/sm/results/cpu_fig3_depth.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanotron_ext.bench import presets  # noqa: E402
from nanotron_ext.bench.paper import PaperClaim, evaluate  # noqa: E402
from nanotron_ext.bench.report import (  # noqa: E402
    help_with_defaults,
    new_figure,
    publish,
    read_saved,
    run_meta,
    script_parser,
)
from nanotron_ext.bench.training import run_training  # noqa: E402
from nanotron_ext.cli_flags import one_line_refusals  # noqa: E402
from nanotron_ext.config.loader import load_config  # noqa: E402

CONFIG = "examples/config_tiny_llama.yaml"
BASE = ["parallelism.dp=1", "parallelism.pp=1", "model.tie_embeddings=false", "tokens.sequence_length=128",
        "tokens.micro_batch_size=8",
        "tokens.batch_accumulation_per_replica=1", "tokens.val_check_interval=50", "tokens.val_steps=8",
        "checkpoints.interval=0", "logging.progress_bar=false", "model.codec.boundaries=every_layer"]
ROWS: Dict[str, List[str]] = {
    "uncompressed": [],
    "sm": ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
           "model.subspace.k=16"],
    "int4": ["model.codec.kind=int4"],
    "lowrank": ["model.codec.kind=lowrank", "model.codec.ratio=8"],
    "topk": ["model.codec.kind=topk", "model.codec.ratio=8"],
}


# GPU preset: the paper's 2B model (d = 4096) at 8 and 16 layers (2B / 3.5B), one GPU, codec after every
# block but the last, k = d/8 = 512 (the ratio of the CPU rows; sm_2b_compressed.yaml has k = 40), equal steps;
# lossy rows at the same ratio
GPU_CONFIG = "reproduce/sm/sm_2b_centralised.yaml"
GPU_BASE = ["parallelism.pp=1", "parallelism.link.enabled=false", "model.codec.boundaries=every_layer"]
GPU_DEPTHS = [8, 16]


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    gpu = args.preset == "gpu"
    config, base = (GPU_CONFIG, GPU_BASE + presets.gpu_overrides(args)) if gpu else (CONFIG, BASE)
    depths = GPU_DEPTHS if gpu and args.depths == [4, 8] else args.depths
    base_seed = load_config(CONFIG, BASE).general.seed
    seeds = args.seeds or [base_seed]
    k = load_config(config, base).model.hidden_size // 8
    rows_ovr = {n: [o if o != "model.subspace.k=16" else f"model.subspace.k={k}" for o in v] for n, v in ROWS.items()}
    if args.dry_run:
        return {"dry_run": presets.dry_run({f"depth{d}_{n} seed "
                                            f"{s}": (config, base + rows_ovr[n] + [f"model.num_layers={d}",
                                            f"general.seed={s}"]) for s in seeds for d in depths for n in args.rows})}
    rows = []
    for seed in seeds:
        for depth in depths:
            for name in ["uncompressed"] + [r for r in args.rows if r != "uncompressed"]:
                ovr = (base + rows_ovr[name] + [f"model.num_layers={depth}"]
                       + ([] if gpu else [f"tokens.train_steps={args.steps}"]))
                run = f"depth{depth}_{name}"
                if seed != base_seed:
                    ovr, run = ovr + [f"general.seed={seed}"], f"{run}_seed{seed}"
                s = run_training(config, ovr, run,
                                 root=ROOT / "runs" / ("sm_depth_gpu" if gpu else "sm_depth"), reuse=True)
                rows.append({"depth": depth, "row": name, "seed": seed, "val_loss": s["final_val_loss"],
                             "train_loss": s["final_train_loss"], "val_curve": s["val_curve"], "overrides": ovr})
                print(f"seed {seed} depth {depth:>2} {name:<13} val {s['final_val_loss']:.4f}", flush=True)
    meta = run_meta({"config": config, "steps": "config" if gpu else args.steps, "depths": depths, "seeds": seeds})
    return {"meta": meta, "rows": rows}


def render(saved: Dict[str, Any]) -> Dict[str, Any]:
    rows, meta = saved["rows"], saved["meta"]
    depths, seeds = meta["depths"], meta["seeds"]
    names = list(dict.fromkeys(r["row"] for r in rows))
    ref = {(r["seed"], r["depth"]): r["val_loss"] for r in rows if r["row"] == "uncompressed"}
    for r in rows:
        r["gap"] = r["val_loss"] - ref[r["seed"], r["depth"]]
    lo, hi = min(depths), max(depths)
    gap = {(r["row"], r["seed"], r["depth"]): r["gap"] for r in rows}
    growth = {n: [gap[n, s, hi] - gap[n, s, lo] for s in seeds] for n in names}

    def se(xs: List[float]) -> Optional[float]:
        return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None

    growth_rows = []
    for n, g in growth.items():
        over = [a - b for a, b in zip(g, growth["sm"])] if "sm" in growth else None
        growth_rows.append({"row": n, "gap_growth": statistics.fmean(g), "gap_growth_se": se(g),
                            "growth_over_sm": statistics.fmean(over) if over else None,
                            "growth_over_sm_se": se(over) if over else None})
    lossy = [n for n in names if n not in ("uncompressed", "sm")]
    claims = [PaperClaim(f"{n}: gap at {hi} layers - gap at {lo}", "gap_growth", None, ">", 0.0, where={"row": n},
                         err_column="gap_growth_se", source="Fig. 3 / Thm. B.1",
                         setting="8 vs 16 layers (2B / 3.5B), C4") for n in lossy]
    claims += [PaperClaim(f"{n}: its gap growth - SM's", "growth_over_sm", None, ">", 0.0, where={"row": n},
                          err_column="growth_over_sm_se", source="Fig. 3",
                          setting="SM on par with centralised at both depths") for n in lossy]
    claims += [PaperClaim(f"sm: gap at {hi} layers - gap at {lo}", "gap_growth", 0.0, "<=", 0.0,
                          where={"row": "sm"}, err_column="gap_growth_se", source="Fig. 3",
                          setting="SM on par with centralised at 8 and 16 layers")]
    verdicts = evaluate(claims, growth_rows)
    fig, axes = new_figure(2)
    for name in names:
        mean = {d: statistics.fmean(r["val_loss"] for r in rows if r["row"] == name
                                    and r["depth"] == d) for d in depths}
        mgap = {d: statistics.fmean(r["gap"] for r in rows if r["row"] == name and r["depth"] == d) for d in depths}
        axes[0].plot(depths, [mean[d] for d in depths], "o-", label=name)
        axes[1].plot(depths, [mgap[d] for d in depths], "o-", label=name)
    axes[0].set(xlabel="layers (codec after every block but the last)",
                ylabel=f"final validation loss (mean of {len(seeds)} seeds)")
    axes[1].set(xlabel="layers", ylabel="validation loss - uncompressed at that depth (mean)")
    axes[1].axhline(0, color="k", lw=0.5)
    for ax in axes:
        ax.set_xticks(depths)
        ax.legend(fontsize=7)
    headers = ["seed", "depth", "row", "val loss", "gap to uncompressed"]
    body = [[r["seed"], r["depth"], r["row"], f"{r['val_loss']:.4f}", f"{r['gap']:+.4f}"] for r in rows]
    meta = {**meta, "gap_growth": growth_rows}
    return {"rows": rows, "meta": meta, "headers": headers, "body": body, "verdicts": verdicts, "figure": fig}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = script_parser(__doc__, "runs/sm/fig3_depth.json")
    from nanotron_ext.cli_flags import Int

    p.add_argument("--depths", type=Int(1), nargs="+", default=[4, 8], help="layer counts compared")
    p.add_argument("--steps", type=Int(1), default=200, help="training steps per run")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows compared")
    presets.add_preset_args(p, f"{GPU_CONFIG} at 8 and 16 layers (2B / 3.5B) on one 80 GB GPU, bf16", seeds=())
    args = help_with_defaults(p).parse_args(argv)
    args.seeds = args.seeds or None
    saved = read_saved(args.from_json) if args.from_json else measure(args)
    if "dry_run" in saved:
        return saved["dry_run"]
    r = render(saved)
    publish(args.out, r["rows"], r["meta"],
            "Subspace Models, Fig. 3 scaled down: compression between every block vs depth",
            r["headers"], r["body"], r["verdicts"], r["figure"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
