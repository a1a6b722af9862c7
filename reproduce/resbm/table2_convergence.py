"""ResBM Table 2 (and the sec. 4.2 optimiser comparison) at CPU scale: final validation perplexity of the
uncompressed AdamW baseline vs ResBM with AdamW and with Muon at two compression ratios.

Paper ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism", arXiv:2604.11947,
Table 2, 2B, 26B C4 tokens, one GPU, bottleneck after every block but the last): baseline AdamW 21.75,
ResBM-Muon 100x 21.60, ResBM-Muon 128x 21.77; sec. 4.2: ResBM-Muon beats ResBM-AdamW at both ratios.

Here: reproduce/resbm/cpu_base.yaml (d = 256, 8 blocks, sotu corpus) on one process, h in {2, 4}
(128x, 64x: d / 100 is not an integer at d = 256), a few hundred steps, RMS-matched Muon at the AdamW
peak lr with 10% / 1% final lr ratios, as the paper.

    python reproduce/resbm/table2_convergence.py --steps 150      # writes cpu_table2.json / .png here
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PAPER_PPL = {"baseline_adamw": 21.75, "resbm_muon_100x": 21.60, "resbm_muon_128x": 21.77}


def variants(h_values: Sequence[int]) -> Dict[str, List[str]]:
    out = {"baseline_adamw": ["model.codec.kind=identity", "optimizer.name=adamw"]}
    for opt in ("adamw", "muon"):
        for h in h_values:
            out[f"resbm_{opt}_h{h}"] = ["model.codec.kind=resbm", "model.codec.boundaries=every_layer",
                                        f"model.codec.resbm.h={h}", f"optimizer.name={opt}"]
    return out


def run(name: str, overrides: List[str], steps: int, extra: List[str]) -> dict:
    out_dir = "runs/resbm_table2"
    sets = [f"general.run={name}", f"general.output_dir={out_dir}", f"tokens.train_steps={steps}",
            "tokens.val_check_interval=0", "tokens.val_steps=16", f"checkpoints.dir={out_dir}/checkpoints/{name}",
            "checkpoints.resume=overwrite", "logging.progress_bar=false", *overrides, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "nanotron_ext.train", "--config-file", "reproduce/resbm/cpu_base.yaml"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = REPO / out_dir / name
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"name": name, "overrides": overrides, "final_val_loss": summary["final_val_loss"],
            "final_val_ppl": summary["final_val_ppl"], "final_train_loss": summary["final_train_loss"],
            "train_losses": losses, "tokens_per_s": summary["tokens_per_s"], "checkpoints": f"{out_dir}/checkpoints/{name}"}


def orderings(rows: Dict[str, dict], h_values: Sequence[int]) -> Dict[str, bool]:
    """The paper's comparisons, on our final validation perplexities (lo = stronger compression)."""
    ppl = {k: r["final_val_ppl"] for k, r in rows.items()}
    lo, hi = min(h_values), max(h_values)
    out = {f"muon beats adamw at h={h}": ppl[f"resbm_muon_h{h}"] < ppl[f"resbm_adamw_h{h}"] for h in h_values}
    out[f"muon h={hi} within 1% of baseline (paper: 100x 0.7% better)"] = ppl[f"resbm_muon_h{hi}"] <= 1.01 * ppl["baseline_adamw"]
    out[f"muon h={lo} within 1% of baseline (paper: 128x 0.1% worse)"] = ppl[f"resbm_muon_h{lo}"] <= 1.01 * ppl["baseline_adamw"]
    out["paper order muon(less compressed) <= baseline <= muon(more compressed)"] = (
        ppl[f"resbm_muon_h{hi}"] <= ppl["baseline_adamw"] <= ppl[f"resbm_muon_h{lo}"])
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--h", type=int, action="append", default=None, help="wire widths (default 2 and 4)")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", type=Path, default=HERE / "cpu_table2.json")
    ap.add_argument("--png", type=Path, default=HERE / "cpu_table2.png")
    ns = ap.parse_args(argv)
    h_values = ns.h or [2, 4]
    rows = {}
    for name, overrides in variants(h_values).items():
        rows[name] = run(name, overrides, ns.steps, ns.set)
        print(f"{name:<18} val loss {rows[name]['final_val_loss']:.4f}  ppl {rows[name]['final_val_ppl']:.2f}", flush=True)
    order = orderings(rows, h_values)
    print("\npaper (2B, 26B tokens):", ", ".join(f"{k} {v}" for k, v in PAPER_PPL.items()))
    for k, v in order.items():
        print(f"{k}: {v}")
    device = f"CPU ({os.cpu_count()} cores), gloo, {datetime.date.today().isoformat()}"
    result = {"device": device, "steps": ns.steps, "paper_ppl": PAPER_PPL, "rows": rows, "orderings": order,
              "command": "python reproduce/resbm/table2_convergence.py " + " ".join(argv or sys.argv[1:])}
    ns.out.write_text(json.dumps(result, indent=1))
    _plot(rows, ns.png, f"ResBM Table 2 at CPU scale (d=256, 8 blocks, {ns.steps} steps) - {device}")
    return result


def _plot(rows: Dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in rows.items():
        losses = r["train_losses"]
        k = 10  # moving average over 10 steps: single-batch losses are noisy
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f"{name} (val ppl {r['final_val_ppl']:.1f})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (10-step mean)")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
