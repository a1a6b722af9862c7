"""Table 2 at CPU scale: uniform vs heterogeneous pipeline compression over the compression ratio d/k,
with M simulated SparseLoCo replicas in one process (nanotron_ext.sparseloco.simulate.run_simulated).

    python reproduce/het_sparseloco/table2_ratio_sweep.py --config-file examples/config_tiny_het_sparseloco.yaml \
        --replicas 4 --compressed 2 --ratios 8 32 128 --out reproduce/het_sparseloco/table2_cpu

Rows: SparseLoCo (no replica compressed), then per ratio r (k = d / r) "uniform" (all M replicas compressed)
and "het" (the first --compressed replicas compressed, the rest not). The codec sits after every layer but
the last (model.codec.boundaries = every_layer: a pipeline of num_layers stages, on one process). Writes
<out>.json (per-step train loss, final validation loss, degradation vs the baseline, paper numbers) and
<out>.png (validation loss vs ratio).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

from nanotron_ext.config.loader import load_config
from nanotron_ext.sparseloco.simulate import run_simulated

# Paper Table 2 (512M, DCLM): ratio -> (uniform loss, heterogeneous loss); SparseLoCo baseline 2.73
PAPER = {"baseline": 2.73, 8: (2.84, 2.82), 24: (2.89, 2.88), 96: (2.96, 2.94), 192: (3.03, 2.97),
         384: (3.04, 2.99), 768: (3.07, 3.00)}


def _run(config_file: str, overrides: List[str], replicas: int) -> Dict[str, object]:
    cfg = load_config(config_file, overrides)
    t0 = time.perf_counter()
    out = run_simulated(cfg, replicas, "sparseloco", config_file)
    return {"train_loss": out["train_loss"], "val_loss": out["val_loss"], "sync_bytes": out["sync_bytes"][:1],
            "wall_s": time.perf_counter() - t0, "overrides": overrides}


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--compressed", type=int, default=2, help="compressed replicas in the heterogeneous rows")
    p.add_argument("--ratios", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    base = args.overrides + [f"parallelism.dp={args.replicas}", "model.codec.boundaries=every_layer"]
    d = load_config(args.config_file, base).model.hidden_size
    baseline = _run(args.config_file, base + ["sparseloco.compressed_replicas=[]"], args.replicas)
    results: Dict[str, Dict[str, object]] = {"baseline": baseline}
    print(f"baseline val {results['baseline']['val_loss']:.4f}", flush=True)
    for ratio in args.ratios:
        if d % ratio:
            raise SystemExit(f"--ratios: hidden_size {d} is not divisible by {ratio}")
        for name, n in (("uniform", args.replicas), ("het", args.compressed)):
            ovr = base + [f"model.subspace.k={d // ratio}", f"sparseloco.compressed_replicas={list(range(n))}"]
            results[f"{name} 1/{ratio}"] = out = _run(args.config_file, ovr, args.replicas)
            out["degradation_pct"] = 100 * (out["val_loss"] / results["baseline"]["val_loss"] - 1)
            print(f"{name:<8} 1/{ratio:<4} val {out['val_loss']:.4f} (+{out['degradation_pct']:.2f}%)  "
                  f"{out['wall_s']:.0f} s", flush=True)
    meta = {"config_file": args.config_file, "overrides": base, "replicas": args.replicas,
            "compressed_in_het": args.compressed, "hidden_size": d, "device": "CPU (2 cores), gloo",
            "date": datetime.date.today().isoformat(), "paper_table2_512m": {str(k): v for k, v in PAPER.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    _plot(results, args.ratios, args.out.with_suffix(".png"), args.replicas, args.compressed)
    return 0


def _plot(results: Dict[str, Dict[str, object]], ratios: List[int], path: Path, m: int, c: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for name, label in (("uniform", f"uniform ({m}/{m} compressed)"), ("het", f"heterogeneous ({c}/{m})")):
        ax.plot(ratios, [results[f"{name} 1/{r}"]["val_loss"] for r in ratios], "o-", label=f"ours: {label}")
    ax.axhline(results["baseline"]["val_loss"], color="k", ls="--", label="ours: SparseLoCo")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression d/k")
    ax.set_ylabel("final validation loss (CPU scale)")
    ax.legend(fontsize=7)
    paper = [r for r in PAPER if r != "baseline"]
    bx.plot(paper, [PAPER[r][0] for r in paper], "o-", label="paper: uniform")
    bx.plot(paper, [PAPER[r][1] for r in paper], "o-", label="paper: heterogeneous (1/2)")
    bx.axhline(PAPER["baseline"], color="k", ls="--", label="paper: SparseLoCo")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("compression d/k")
    bx.set_ylabel("final loss (512M, DCLM)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
