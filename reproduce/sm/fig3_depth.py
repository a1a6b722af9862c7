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

Reported per depth: final validation loss and its gap to the uncompressed model of that depth. The paper's
ordering: SM's gap stays small at both depths; a lossy codec's gap grows with depth.

    .venv/bin/python reproduce/sm/fig3_depth.py                 # writes reproduce/sm/cpu_fig3_depth.{json,md,png}
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanotron_ext.bench.paper import PaperClaim, evaluate  # noqa: E402
from nanotron_ext.bench.report import new_figure, run_meta, write_report  # noqa: E402
from nanotron_ext.bench.training import run_training  # noqa: E402

CONFIG = "examples/config_tiny_llama.yaml"
BASE = ["parallelism.dp=1", "parallelism.pp=1", "model.tie_embeddings=false", "tokens.sequence_length=128", "tokens.micro_batch_size=8",
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--out", type=Path, default=ROOT / "reproduce" / "sm" / "cpu_fig3_depth.json")
    args = p.parse_args()
    rows = []
    for depth in args.depths:
        for name in ["uncompressed"] + [r for r in args.rows if r != "uncompressed"]:
            ovr = BASE + ROWS[name] + [f"model.num_layers={depth}", f"tokens.train_steps={args.steps}"]
            s = run_training(CONFIG, ovr, f"depth{depth}_{name}", root=ROOT / "runs" / "sm_depth", reuse=True)
            rows.append({"depth": depth, "row": name, "val_loss": s["final_val_loss"], "train_loss": s["final_train_loss"],
                         "val_curve": s["val_curve"], "overrides": ovr})
            print(f"depth {depth:>2} {name:<13} val {s['final_val_loss']:.4f}", flush=True)
    ref = {r["depth"]: r["val_loss"] for r in rows if r["row"] == "uncompressed"}
    for r in rows:
        r["gap"] = r["val_loss"] - ref[r["depth"]]
    lo, hi = min(args.depths), max(args.depths)
    growth = {}
    for name in args.rows:
        gaps = {r["depth"]: r["gap"] for r in rows if r["row"] == name}
        growth[name] = gaps[hi] - gaps[lo]
    growth_rows = [{"row": n, "gap_growth": g, "growth_over_sm": g - growth["sm"] if "sm" in growth else None}
                   for n, g in growth.items()]
    lossy = [n for n in args.rows if n not in ("uncompressed", "sm")]
    claims = [PaperClaim(f"{n}: gap at {hi} layers - gap at {lo}", "gap_growth", None, ">", 0.0, where={"row": n},
                         source="Fig. 3 / Thm. B.1", setting="8 vs 16 layers (2B / 3.5B), C4") for n in lossy]
    claims += [PaperClaim(f"{n}: its gap growth - SM's", "growth_over_sm", None, ">", 0.0, where={"row": n},
                          source="Fig. 3", setting="SM on par with centralised at both depths") for n in lossy]
    claims += [PaperClaim(f"sm: gap at {hi} layers - gap at {lo} (value only)", "gap_growth", None, None,
                          where={"row": "sm"}, source="Fig. 3")]
    verdicts = evaluate(claims, growth_rows)
    for v in verdicts:
        print(v.line())
    fig, axes = new_figure(2)
    for name in args.rows:
        pts = [(r["depth"], r["val_loss"], r["gap"]) for r in rows if r["row"] == name]
        axes[0].plot([d for d, _, _ in pts], [v for _, v, _ in pts], "o-", label=name)
        axes[1].plot([d for d, _, _ in pts], [g for _, _, g in pts], "o-", label=name)
    axes[0].set(xlabel="layers (codec after every block but the last)", ylabel="final validation loss")
    axes[1].set(xlabel="layers", ylabel="validation loss - uncompressed at that depth")
    axes[1].axhline(0, color="k", lw=0.5)
    for ax in axes:
        ax.set_xticks(args.depths)
        ax.legend(fontsize=7)
    meta = run_meta({"config": CONFIG, "steps": args.steps, "depths": args.depths})
    headers = ["depth", "row", "val loss", "gap to uncompressed"]
    body = [[r["depth"], r["row"], f"{r['val_loss']:.4f}", f"{r['gap']:+.4f}"] for r in rows]
    write_report(args.out, rows, meta, "Subspace Models, Fig. 3 scaled down: compression between every block vs depth",
                 headers, body, verdicts, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
