"""MAPL's findings about boundary activations and learned projections, measured on MAPL checkpoints at CPU
scale: the rank the activations need for 99% of their energy, the isometry of the projection (Pearson r of
token-pair cosine similarities before and after it), the energy a learned basis keeps against a random one,
and principal angles between the boundaries' subspaces.

Paper: "Learned Subspace Compression for Communication-Efficient Pipeline Parallelism" (MAPL,
arXiv:2606.05484): sec. 3.1 "boundary residual activations (after subtracting token embeddings) are
intrinsically low-rank: on a 150M LLaMA (d = 1024) a rank of ~250 preserves >= 99% of the energy"; Key
findings: learned A_p keeps ~80% of the residual energy vs ~36% for a fixed random basis (r = 128, 1500
steps); post-projection token cosine similarity correlates with the original at Pearson r = 0.992; principal
angles ~53 degrees between adjacent stages, up to 72 between far ones.

What is measured (nanotron_ext.mapl.analyse on each run's final checkpoint, 8 validation batches): at every
boundary the sender's X - anchor(ids) (what A_p compresses); the smallest k whose best rank-k basis keeps 99%
of its energy; the Pearson r over 4096 random token pairs of cos(x_i, x_j) against cos(x_i A, x_j A), for the
learned A_p and for a random orthonormal basis of the same rank (the yardstick: random projections keep
cosines roughly too); the energy kept by both; the mean principal angle between boundaries. Each statistic
is averaged over the boundaries of a run, then mean +- s.e. over seeds. The 99% rank is also given for the
centred activations: a direction common to all tokens can hold nearly all of the raw energy on its own.

Readings of claims the text states in words (our choices): "nearly identical" cosines = Pearson r >= 0.99;
"intrinsically low-rank" = the 99% rank is under half of d (the paper's is 0.24 d).

CPU preset: the SPEL runs of manifold_ablation.py (reproduce/mapl/cpu_small.yaml, d = 128, r = 32 = d/4,
P = 8 as a boundary after every layer, 150 steps, seeds 42 43 44); a run already trained there is reused.
GPU preset: reproduce/mapl/mapl_1b.yaml (1.0B, d = 2048, r = 256, bf16), P = 8 simulated, one GPU.

    .venv/bin/python reproduce/mapl/activation_findings.py           # runs/mapl/activation_findings.*
    .venv/bin/python reproduce/mapl/activation_findings.py --preset gpu --data /data/dclm/jsonl --dry-run
    .venv/bin/python reproduce/mapl/activation_findings.py \
        --from-json reproduce/mapl/results/cpu_activation_findings.json
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
from reproduce.mapl.common import CPU_CONFIG, GPU_CONFIG, analyse, boundary_mean, row_runs, train  # noqa: E402

TITLE = "MAPL findings on trained checkpoints: 99% energy rank, pair-cosine isometry, energy kept, angles (P = 8)"
PAPER = {"rank99_over_d": 250 / 1024, "energy_learned": 0.80, "energy_random": 0.36, "pearson": 0.992,
         "adjacent_angle": 53.0, "far_angle": 72.0}
STATS = ("rank99_over_d", "rank99_centred_over_d", "energy_learned", "energy_random", "energy_ratio",
         "pearson_learned", "pearson_random",
         "adjacent_angle_deg", "far_angle_deg", "far_minus_adjacent_deg", "angle_to_init_deg")


def per_run(analysis: Dict[str, Any]) -> Dict[str, float]:
    """One run's statistics, averaged over its boundaries."""
    rows = analysis["boundaries"]
    angles = analysis["meta"]["mean_principal_angle_deg"]
    pairs = {tuple(int(x) for x in k.split("-")): v for k, v in angles.items()}
    order = sorted(int(r["boundary"]) for r in rows)
    adjacent = [pairs[a, b] for a, b in zip(order, order[1:])]
    far = pairs[order[0], order[-1]]
    out = {"rank99_over_d": boundary_mean(analysis, "rank_99") / rows[0]["d"],
           "rank99_centred_over_d": boundary_mean(analysis, "rank_99_centred") / rows[0]["d"],
           "energy_learned": boundary_mean(analysis, "energy_learned"),
           "energy_random": boundary_mean(analysis, "energy_random"),
           "pearson_learned": boundary_mean(analysis, "pearson_learned"),
           "pearson_random": boundary_mean(analysis, "pearson_random"),
           "adjacent_angle_deg": sum(adjacent) / len(adjacent), "far_angle_deg": far,
           "angle_to_init_deg": boundary_mean(analysis, "mean_angle_to_init_deg"),
           "random_pair_angle_deg": analysis["meta"]["random_pair_mean_angle_deg"]}
    out["energy_ratio"] = out["energy_learned"] / out["energy_random"]
    out["far_minus_adjacent_deg"] = far - out["adjacent_angle_deg"]
    return out


def measure(args: Any, torchrun_args: Sequence[str]) -> Dict[str, Any]:
    planned = row_runs(["spel"], args.seeds, args)
    if args.dry_run:
        return {"dry_run": presets.dry_run(planned)}
    runs, boundaries = [], []
    for key, (config, overrides) in planned.items():
        seed = int(key.split(" seed ")[1])
        a = analyse(train(key, config, overrides, torchrun_args))
        runs.append({"seed": seed, **per_run(a)})
        boundaries += [{"seed": seed, **b} for b in a["boundaries"]]
        print(f"seed {seed}: " + ", ".join(f"{k} {runs[-1][k]:.3f}" for k in STATS), flush=True)
    gpu = args.preset == "gpu"
    meta = br.run_meta({"config": GPU_CONFIG if gpu else args.config_file, "steps": None if gpu else args.steps,
                        "preset": args.preset, "seeds": args.seeds, "P": 8,
                        "command": "python reproduce/mapl/activation_findings.py " + " ".join(args.argv)})
    return {"meta": meta, "rows": runs, "boundaries": boundaries}


def summary(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for k in STATS:
        m, e = mean_se([r[k] for r in runs])
        out.append({"key": k, "value": m, "err": e})
    return out


def claims(chance_angle: float) -> List[PaperClaim]:
    kw = dict(column="value", err_column="err", setting="150M, d = 1024, r = 128-256")
    return [
        PaperClaim("rank for 99% energy / d ('intrinsically low-rank', read: < d/2)", paper=PAPER["rank99_over_d"],
                   relation="<", than=0.5, where={"key": "rank99_over_d"}, source="sec. 3.1", **kw),
        PaperClaim("rank for 99% energy / d, activations centred (our addition: the text does not say)",
                   paper=PAPER["rank99_over_d"], relation=None,
                   where={"key": "rank99_centred_over_d"}, source="sec. 3.1",
                   **kw),
        PaperClaim("pair-cosine Pearson r through the learned A_p ('nearly identical', read: >= 0.99)",
                   paper=PAPER["pearson"], relation=">=", than=0.99, where={"key": "pearson_learned"},
                   source="Key findings", **kw),
        PaperClaim("energy kept, learned / random basis ('2.2x')",
                   paper=PAPER["energy_learned"] / PAPER["energy_random"],
                   relation=">", than=1.0, where={"key": "energy_ratio"}, source="Key findings", **kw),
        PaperClaim("energy kept by the learned A_p", paper=PAPER["energy_learned"], relation=None,
                   where={"key": "energy_learned"}, source="Key findings", **kw),
        PaperClaim(f"mean principal angle, adjacent boundaries (deg; below two random bases' {chance_angle:.1f})",
                   paper=PAPER["adjacent_angle"], relation="<", than=round(chance_angle, 1),
                   where={"key": "adjacent_angle_deg"}, source="sec. 3 (design 1)", **kw),
        PaperClaim("first-to-last minus adjacent principal angle (deg; far stages nearer orthogonal)",
                   paper=PAPER["far_angle"] - PAPER["adjacent_angle"], relation=">", than=0.0,
                   where={"key": "far_minus_adjacent_deg"}, source="sec. 3 (design 1)", **kw),
    ]


def render(saved: Dict[str, Any]) -> Dict[str, Any]:
    runs, bounds = saved["rows"], saved["boundaries"]
    seeds = sorted({b["seed"] for b in bounds})
    headers = ["boundary (sending layer)", "rank for 99% energy", "centred", "energy kept: learned", "random",
               "Pearson r: learned",
               "random", "max |A^T A - I|", "turned from init (deg)"]
    body = []
    for b in sorted({int(x["boundary"]) for x in bounds}):
        mine = [x for x in bounds if int(x["boundary"]) == b]

        def avg(key: str, mine: List[Dict[str, Any]] = mine) -> float:
            return sum(float(x[key]) for x in mine) / len(mine)

        body.append([b, f"{avg('rank_99'):.1f} of {mine[0]['d']}", f"{avg('rank_99_centred'):.1f}",
                     f"{avg('energy_learned'):.3f}",
                     f"{avg('energy_random'):.3f}", f"{avg('pearson_learned'):.4f}", f"{avg('pearson_random'):.4f}",
                     f"{max(float(x['stiefel_error']) for x in mine):.1e}", f"{avg('mean_angle_to_init_deg'):.1f}"])
    summ = summary(runs)
    chance = runs[0]["random_pair_angle_deg"]
    notes = [f"Per boundary: mean over seeds {seeds} (rank {bounds[0]['rank']} of d = {bounds[0]['d']}). Summary over "
             "seeds (each run averaged over its boundaries): "
             + "; ".join(f"{s['key']} {s['value']:.3f}" + ("" if s["err"] is None else f" +- {s['err']:.3f}")
                         for s in summ)]
    return {"headers": headers, "body": body, "verdicts": evaluate(claims(chance), summ), "notes": notes,
            "figure": _plot(bounds), "extra": {"boundaries": bounds, "summary": summ}}


def _plot(bounds: List[Dict[str, Any]]) -> Any:
    fig, (ax1, ax2) = br.new_figure(2, width=5.5, height=4.2)
    xs = sorted({int(x["boundary"]) for x in bounds})

    def series(key: str) -> List[float]:
        return [sum(float(x[key]) for x in bounds if int(x["boundary"]) == b)
                / sum(1 for x in bounds if int(x["boundary"]) == b) for b in xs]

    d = bounds[0]["d"]
    ax1.bar([b - 0.2 for b in xs], series("rank_99"), 0.4, label="rank for 99% energy")
    ax1.bar([b + 0.2 for b in xs], series("rank_99_centred"), 0.4, label="the same, centred")
    ax1.axhline(bounds[0]["rank"], color="k", ls=":", lw=0.8, label=f"wire rank r = {bounds[0]['rank']}")
    ax1.axhline(250 / 1024 * d, color="tab:red", ls="--", lw=0.8, label="paper's 250 / 1024, scaled to d")
    ax1.set(xlabel="boundary (sending layer)", ylabel=f"rank (of d = {d})")
    ax1.legend(fontsize=7)
    ax2.plot(xs, series("pearson_learned"), "o-", label="Pearson r, learned A_p")
    ax2.plot(xs, series("pearson_random"), "s--", label="Pearson r, random basis")
    ax2.plot(xs, series("energy_learned"), "o-", label="energy kept, learned")
    ax2.plot(xs, series("energy_random"), "s--", label="energy kept, random")
    ax2.axhline(0.992, color="tab:red", ls=":", lw=0.8, label="paper: r = 0.992")
    ax2.set(xlabel="boundary (sending layer)", ylim=(0, 1.02))
    ax2.legend(fontsize=7)
    return fig


def build_parser() -> Any:
    p = br.script_parser(__doc__, "runs/mapl/activation_findings.json")
    p.add_argument("--config-file", default=CPU_CONFIG, type=CONFIG,
                   help="CPU preset: the base config")
    p.add_argument("--steps", type=Int(1), default=150, help="CPU preset: training steps per run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config overrides for every run")
    presets.add_preset_args(p, f"{GPU_CONFIG} (1.0B, r = 256, bf16) on one 80 GB GPU, P = 8 simulated",
                            seeds=(42, 43, 44))
    return br.help_with_defaults(p)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    return presets.script_main(argv, build_parser, measure, render, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
