"""CPU-scale sweeps with simulated replicas: M data-parallel replicas of a config trained one after another
in one process (nanotron_ext.sparseloco.simulate.run_simulated, equal to the trainer bit for bit).

    python reproduce/het_sparseloco/sim_sweep.py --config-file examples/config_tiny_sparseloco.yaml \
        --replicas 4 --set tokens.train_steps=100 \
        --variant dense --variant topk=32 --variant topk=4096,value_dtype=fp32 --out reproduce/het_sparseloco/cpu_sweep

A variant is "dense" (gradients averaged every step: the paper's AdamW rows) or comma-separated
`sparseloco.*` overrides. Writes <out>.json (per-step mean train loss, final validation loss, bytes per
replica per sync) and <out>.png (train loss curves).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List

from nanotron_ext.config.loader import load_config
from nanotron_ext.sparseloco.simulate import run_simulated


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    results = {}
    for variant in args.variant:
        extra = [] if variant == "dense" else [f"sparseloco.{kv}" for kv in variant.split(",") if kv]
        cfg = load_config(args.config_file, args.overrides + extra)
        t0 = time.perf_counter()
        out = run_simulated(cfg, args.replicas, "dense" if variant == "dense" else "sparseloco", args.config_file)
        out.pop("weights")
        out.pop("models", None)  # modules are not JSON
        out["wall_s"] = time.perf_counter() - t0
        results[variant] = out
        print(f"{variant:<40} final train {out['train_loss'][-1]:.4f}  val {out['val_loss']:.4f}  "
              f"bytes/sync/replica {out['sync_bytes'][:1]}  ({out['wall_s']:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config_file": args.config_file, "overrides": args.overrides, "replicas": args.replicas}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, out in results.items():
        ax.plot(range(1, len(out["train_loss"]) + 1), out["train_loss"], label=f"{variant} (val {out['val_loss']:.3f})")
    ax.set_xlabel("inner step")
    ax.set_ylabel(f"train loss (mean of {args.replicas} replicas)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
