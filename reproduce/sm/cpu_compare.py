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

    .venv/bin/python reproduce/sm/cpu_compare.py [--steps 200] [--rows sm,topk] [--out reproduce/sm]

Each row runs `torchrun --standalone --nproc_per_node 2 -m nanotron_ext.train` on
examples/config_tiny_llama.yaml with the overrides below; runs go to runs/sm/<row>/. Writes
cpu_table1.json (final train / validation loss, perplexity, tokens/s, pipeline bytes per step, wall time,
the paper's numbers beside) and cpu_convergence.png (train loss vs step and vs wall-clock time).
Needs the data: python -m nanotron_ext.data prepare --config-file examples/config_tiny_llama.yaml
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanotron_ext.fileio import write_text_atomic  # noqa: E402

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
        curve.append({"step": m["step"], "loss": m["loss"], "wall_s": wall, **({"val_loss": m["val_loss"]} if "val_loss" in m else {})})
    return {"overrides": [o.format(mbps=mbps) for o in ROWS[name]], "summary": summary, "curve": curve, "train_wall_s": wall,
            "elapsed_s": (datetime.datetime.now() - t0).total_seconds()}


def plot(results: Dict[str, Dict[str, object]], path: Path, mbps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        c = r["curve"]
        axes[0].plot([p["step"] for p in c], [p["loss"] for p in c], label=name, lw=1)
        axes[1].plot([p["wall_s"] for p in c], [p["loss"] for p in c], label=name, lw=1)
    axes[0].set(xlabel="optimiser step", ylabel="train loss", title="same steps")
    axes[1].set(xlabel="wall-clock training time (s, emulated links)", ylabel="train loss", title="same time")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("Subspace Models, CPU scale (2 cores, gloo, PP=2, d=128, k=16; slow link %s Mbit/s)" % mbps, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mbps", type=float, default=10.0, help="slow-link bandwidth (Mbit/s) of the non-centralised rows")
    parser.add_argument("--out", default=str(ROOT / "reproduce" / "sm"))
    parser.add_argument("--seed", type=int, default=None,
                        help="another general.seed: rows are stored under 'seeds' (the main table keeps the config's seed)")
    args = parser.parse_args()
    out = Path(args.out)
    table_path = out / "cpu_table1.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {"rows": {}}
    for name in args.rows.split(","):
        print(f"== {name}", flush=True)
        row = run_row(name, args.steps, args.nproc, args.mbps, args.seed)
        if args.seed is None:
            table["rows"][name] = row
        else:  # only the summary: the main table and its plot keep the config's seed
            table.setdefault("seeds", {}).setdefault(name, {})[str(args.seed)] = row["summary"]
        s = row["summary"]
        print(f"   train {s['final_train_loss']:.3f} val {s['final_val_loss']:.3f} ppl {s['final_val_ppl']:.1f} "
              f"tok/s {s['tokens_per_s']:.0f} pp bytes/step {s['comm_bytes_per_step'].get('pp')}", flush=True)
        table.update({"device": "CPU (2 cores), gloo", "date": datetime.date.today().isoformat(), "steps": args.steps, "slow_link_mbps": args.mbps,
                      "base_overrides": BASE, "paper_table1": PAPER_TABLE1})
        write_text_atomic(table_path, json.dumps(table, indent=1))
    plot(table["rows"], out / "cpu_convergence.png", args.mbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
