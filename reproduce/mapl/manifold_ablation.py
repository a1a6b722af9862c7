"""MAPL's manifold-unaware ablation at CPU scale: the boundary projections A_p trained by SPEL on the
Stiefel manifold vs trained as plain matrices, re-orthonormalised naively, or not trained at all.

Paper: "Learned Subspace Compression for Communication-Efficient Pipeline Parallelism" (MAPL,
arXiv:2606.05484), sec. 3 design 3 and "Highlights": plain gradient updates push A_p off the Stiefel
manifold ("manifold escape") and "manifold-unaware learning is even worse than fixed bases"; learned
(SPEL) bases beat fixed ones ("Learning > Fixed"). The text gives no numbers for the ablation, only the
ordering, so every claim here is an ordering of validation losses (paired over seeds).

Rows (optimizer.spel.mode; everything else equal: same momentum, polar direction and lr 0.1x Muon's):
    spel          SPEL: Riemannian gradient, heavy ball, PolarExpress direction, polar retraction
    fixed         A_p never trained: the seeded random orthonormal basis (anchors still learn)
    euclidean     the raw Euclidean gradient, A <- A - lr D, no retraction: A leaves the manifold and the
                  receiver's A^T is no longer its inverse
    euclidean_qr  the same step, then A <- qr(A).Q: back on the manifold, but the step ignored it
    uncompressed  the same model without codec: the yardstick for degradation

CPU preset: reproduce/mapl/cpu_small.yaml (d = 128, 8 layers, r = 32, the paper's hybrid optimiser with
Muon's orthogonalisation in fp32 for speed), P = 8 simulated as a codec boundary after every layer,
150 steps, seeds 42 43 44; max |A^T A - I| of each row's final projections is measured from its
checkpoint (nanotron_ext.mapl.analyse). The runs are shared with activation_findings.py. GPU preset:
reproduce/mapl/mapl_1b.yaml (1.0B, r = 256, bf16), P = 8 simulated over its 16 layers, on one GPU.

    .venv/bin/python reproduce/mapl/manifold_ablation.py                      # runs/mapl/manifold_ablation.*
    .venv/bin/python reproduce/mapl/manifold_ablation.py --preset gpu --data /data/dclm/jsonl --seeds 42 43 --dry-run
    .venv/bin/python reproduce/mapl/manifold_ablation.py --from-json reproduce/mapl/results/cpu_manifold_ablation.json
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanotron_ext.bench import presets  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench.paper import PaperClaim, evaluate, mean_se  # noqa: E402
from nanotron_ext.cli_flags import CONFIG, Int, KeyValue, one_line_refusals  # noqa: E402
from reproduce.mapl.common import CPU_CONFIG, GPU_CONFIG, ROWS, analyse, boundary_mean, row_runs, train  # noqa: E402

TITLE = "MAPL manifold-unaware ablation: validation loss by how A_p is trained (P = 8)"
SRC = "sec. 3 (design 3), Highlights"


def measure(args: Any, torchrun_args: Sequence[str]) -> Dict[str, Any]:
    runs = row_runs(args.rows, args.seeds, args)
    if args.dry_run:
        return {"dry_run": presets.dry_run(runs)}
    rows = []
    for key, (config, overrides) in runs.items():
        name, seed = key.split(" seed ")[0], int(key.split(" seed ")[1])
        s = train(key, config, overrides, torchrun_args)
        row = {"row": name, "seed": seed, "val_loss": s["final_val_loss"], "val_curve": s["val_curve"],
               "tokens_per_s": s.get("tokens_per_s")}
        if name != "uncompressed":
            a = analyse(s)
            row.update(stiefel_error=max(float(b["stiefel_error"]) for b in a["boundaries"]),
                       energy_learned=boundary_mean(a, "energy_learned"),
                       mean_angle_to_init_deg=boundary_mean(a, "mean_angle_to_init_deg"))
        rows.append(row)
        print(f"{name:<13} seed {seed}: val loss {row['val_loss']:.4f}"
              + (f", max |A^T A - I| {row['stiefel_error']:.1e}" if "stiefel_error" in row else ""), flush=True)
    gpu = args.preset == "gpu"
    meta = br.run_meta({"config": GPU_CONFIG if gpu else args.config_file, "steps": None if gpu else args.steps,
                        "preset": args.preset, "seeds": args.seeds, "P": 8,
                        "command": "python reproduce/mapl/manifold_ablation.py " + " ".join(args.argv)})
    return {"meta": meta, "rows": rows}


def comparisons(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Paired (same-seed) validation-loss differences, mean +- s.e. over seeds."""
    loss = {(r["row"], r["seed"]): r["val_loss"] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = []
    for a, b in (("euclidean", "fixed"), ("euclidean", "spel"), ("euclidean_qr", "spel"), ("fixed", "spel"),
                 ("spel", "uncompressed")):
        value, err = mean_se([loss[a, s] - loss[b, s] for s in seeds if (a, s) in loss and (b, s) in loss])
        out.append({"key": f"{a} - {b}", "value": value, "err": err})
    return out


def claims() -> List[PaperClaim]:
    kw = dict(column="value", paper=None, err_column="err", source=SRC, setting="MAPL, Stiefel projections")
    return [
        PaperClaim("manifold-unaware (euclidean) minus fixed bases, val loss: 'even worse than fixed'", relation=">",
                   than=0.0, where={"key": "euclidean - fixed"}, **kw),
        PaperClaim("manifold-unaware (euclidean) minus SPEL, val loss", relation=">", than=0.0,
                   where={"key": "euclidean - spel"}, **kw),
        PaperClaim("fixed bases minus SPEL, val loss ('Learning > Fixed')", relation=">", than=0.0,
                   where={"key": "fixed - spel"}, **kw),
        PaperClaim("naive QR re-orthonormalisation minus SPEL, val loss (our row; not in the text)", relation=None,
                   where={"key": "euclidean_qr - spel"}, **kw),
        PaperClaim("SPEL minus uncompressed, val loss (150M main table: +0.035 at P = 8)", relation=None,
                   where={"key": "spel - uncompressed"}, **{**kw, "paper": 0.035, "source": "main table, 150M"}),
    ]


def render(saved: Dict[str, Any]) -> Dict[str, Any]:
    rows = saved["rows"]
    order = [n for n in ROWS if any(r["row"] == n for r in rows)]
    headers = ["row", "seeds", "val loss (mean +- s.e.)", "per seed", "max |A^T A - I|",
               "energy kept (mean over boundaries)",
               "turned from init (deg)"]
    body = []
    for n in order:
        mine = [r for r in rows if r["row"] == n]
        m, e = mean_se([r["val_loss"] for r in mine])
        stiefel = [r["stiefel_error"] for r in mine if "stiefel_error" in r]
        energy = mean_se([r["energy_learned"] for r in mine if "energy_learned" in r])[0]
        turned = mean_se([r["mean_angle_to_init_deg"] for r in mine if "mean_angle_to_init_deg" in r])[0]
        body.append([n, len(mine), f"{m:.4f}" + ("" if e is None else f" +- {e:.4f}"),
                     ", ".join(f"{r['val_loss']:.4f}" for r in mine), f"{max(stiefel):.1e}" if stiefel else "-",
                     "-" if energy is None else f"{energy:.3f}", "-" if turned is None else f"{turned:.1f}"])
    comps = comparisons(rows)
    notes = ["Orderings are judged on same-seed differences (2 standard errors); the paper states no numbers "
             "for this ablation, so each verdict is an ordering only (and 'held in direction only' cannot apply)."]
    return {"headers": headers, "body": body, "verdicts": evaluate(claims(), comps), "figure": _plot(rows, order),
            "notes": notes, "extra": {"comparisons": comps}}


def _plot(rows: List[Dict[str, Any]], order: List[str]) -> Any:
    fig, (ax1, ax2) = br.new_figure(2, width=5.5, height=4.2)
    means = [mean_se([r["val_loss"] for r in rows if r["row"] == n]) for n in order]
    ax1.bar(order, [m for m, _ in means], yerr=[e or 0 for _, e in means], capsize=3,
            color=["tab:gray" if n == "uncompressed" else "tab:blue" for n in order])
    lo = min(r["val_loss"] for r in rows)
    ax1.set(ylabel="validation loss (mean +- s.e. over seeds)", ylim=(lo - 0.1, None))
    ax1.tick_params(axis="x", rotation=20)
    named = [n for n in order if n != "uncompressed"]
    ax2.bar(named, [max(r.get("stiefel_error", 0) for r in rows if r["row"] == n) + 1e-16 for n in named])
    ax2.set(yscale="log", ylabel="max |A^T A - I| of the final projections")
    ax2.tick_params(axis="x", rotation=20)
    return fig


def build_parser() -> Any:
    p = br.script_parser(__doc__, "runs/mapl/manifold_ablation.json")
    p.add_argument("--config-file", default=CPU_CONFIG, type=CONFIG,
                   help="CPU preset: the base config")
    p.add_argument("--steps", type=Int(1), default=150, help="CPU preset: training steps per run")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config overrides for every run")
    presets.add_preset_args(p, f"{GPU_CONFIG} (1.0B, r = 256, batch 512 x 2048, bf16) on one 80 GB GPU, P = 8 "
                               "simulated", seeds=(42, 43, 44))
    return br.help_with_defaults(p)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    return presets.script_main(argv, build_parser, measure, render, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
