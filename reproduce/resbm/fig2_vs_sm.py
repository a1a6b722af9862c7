"""ResBM Fig. 2 (ResBM vs Subspace Models at the same compression ratio, AdamW and Muon), Fig. C.2 (the Muon
baseline beats the AdamW baseline) and Fig. 1 (singular-value spectra of the FFN output projections of the
two baselines: AdamW's decay fast, Muon's stay high) from one set of runs.

Paper: "ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism" (arXiv:2604.11947),
sec. 4.2 / Fig. 2: at 100x and 128x "ResBM consistently outperforms SM when controlling for the optimizer"
and "ResBM paired with Muon significantly outperforms ResBM with AdamW"; Fig. C.2: "the Muon-optimized
baseline (no compression) outperforms the AdamW baseline"; sec. 3.4 / Fig. 1: "AdamW exhibits rapid singular
value decay (low-rank structure), while Muon maintains larger singular values across more dimensions" (FFN
output projections of the baselines). The paper gives curves, no numbers: every claim is an ordering.

Rows (one run per row and seed): baseline AdamW and Muon (no codec); ResBM and SM, each with AdamW and with
Muon, at the wire widths nearest 100x and 128x (the same width for both designs: ResBM sends h values, SM k
values and the token id). SM: model.codec.kind = subspace (split embedding, W_out = U W_small). Codecs
after every block but the last, on one process, as Table 2.

CPU preset: reproduce/resbm/cpu_base.yaml as table2_convergence.py (d = 256, 8 blocks, batch 4 x 2 x 128,
150 steps, val 16 batches; h = 3 (85x) and 2 (128x)), Muon's orthogonalisation in fp32 for speed, seeds 42 43
44. Orderings are judged on same-seed differences of the final validation loss (2 standard errors); Fig. 1
on the layer-mean effective rank sum(s^2) / max(s^2) of each baseline's mlp.down_proj weights
(nanotron_ext.resbm.analyse). GPU preset: the 2B configs resbm_2b_*.yaml (SM rows: the baseline config
with the subspace codec at k = 40 / 32), one 80 GB GPU.

    .venv/bin/python reproduce/resbm/fig2_vs_sm.py                          # runs/resbm/fig2_vs_sm.{json,md,png}
    .venv/bin/python reproduce/resbm/fig2_vs_sm.py --preset gpu --data /data/c4/jsonl --seeds 42 43 --dry-run
    .venv/bin/python reproduce/resbm/fig2_vs_sm.py --from-json reproduce/resbm/results/cpu_fig2_vs_sm.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from nanotron_ext.bench import presets  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench.paper import PaperClaim, evaluate, mean_se  # noqa: E402
from nanotron_ext.bench.training import latest_checkpoint_of, run_training  # noqa: E402
from nanotron_ext.cli_flags import Int, KeyValue, one_line_refusals  # noqa: E402
from reproduce.resbm.common import nearest_h  # noqa: E402

CPU_CONFIG = "reproduce/resbm/cpu_base.yaml"
TITLE = "ResBM Figs. 2, C.2, 1: ResBM vs SM at equal ratio, Muon vs AdamW baselines, FFN spectra"
PAPER_RATIOS = (100, 128)
GPU_H = {100: 40, 128: 32}
# Table 2's CPU settings (table2_convergence.py) and Muon's orthogonalisation in fp32 (optimizer.muon_ns_dtype)
CPU_COMMON = ["tokens.batch_accumulation_per_replica=2", "tokens.val_check_interval=0", "tokens.val_steps=16",
              "logging.progress_bar=false", "optimizer.muon_ns_dtype=fp32"]
FFN_OUT = r"mlp\.down_proj\.weight"
# the 2B Muon rows' optimiser keys (as resbm_2b_*_muon.yaml); the CPU base config already carries them
GPU_MUON = ["optimizer.muon_lr=2.0e-4", "optimizer.muon_adjust_lr=match_rms_adamw", "optimizer.muon_min_lr_ratio=0.1"]


def codec(design: str, h: int) -> List[str]:
    if design == "resbm":
        return ["model.codec.kind=resbm", "model.codec.boundaries=every_layer", f"model.codec.resbm.h={h}"]
    return ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
            "model.codec.boundaries=every_layer", f"model.subspace.k={h}"]


def variants(hs: Dict[int, int], gpu: bool) -> Dict[str, Tuple[str, List[str]]]:
    """row -> (config file, overrides); hs: paper ratio -> our width."""
    base = "reproduce/resbm/resbm_2b_baseline.yaml" if gpu else CPU_CONFIG

    def opt(name: str) -> List[str]:
        return [f"optimizer.name={name}", *(GPU_MUON if gpu and name == "muon" else [])]

    out = {f"baseline_{o}": (base, ["model.codec.kind=identity", *opt(o)]) for o in ("adamw", "muon")}
    for ratio, h in hs.items():
        for o in ("adamw", "muon"):
            if gpu:  # the committed 2B ResBM files carry h, optimiser and schedule
                out[f"resbm_{o}_{ratio}x"] = (f"reproduce/resbm/resbm_2b_{ratio}x_{o}.yaml", [])
            else:
                out[f"resbm_{o}_{ratio}x"] = (base, [*codec("resbm", h), *opt(o)])
            out[f"sm_{o}_{ratio}x"] = (base, [*codec("sm", h), *opt(o)])
    return out


def describe(row: str, hs: Dict[int, int], d: int) -> Dict[str, Any]:
    design, opt, ratio = (row.split("_") + [""])[:3]
    if design == "baseline":
        return {"design": "baseline", "optimizer": opt, "paper_ratio": None, "h": d, "ratio": 1.0}
    h = hs[int(ratio[:-1])]
    return {"design": "ResBM" if design == "resbm" else "SM", "optimizer": opt, "paper_ratio": int(ratio[:-1]),
            "h": h, "ratio": d / h}


def train_losses(run_dir: Path) -> List[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in sorted(recs, key=lambda r: r["step"]) if "loss" in r]


def ffn_spectra(summary: Dict[str, Any]) -> Dict[str, Any]:
    """Effective rank per layer and the layer-mean normalised spectrum of the FFN output projections."""
    from nanotron_ext.resbm.analyse import analyse

    rows = analyse([latest_checkpoint_of(summary)], ["x"], FFN_OUT)["x"]
    r_eff = [r["r_eff"] for r in sorted(rows.values(), key=lambda r: r["layer"])]
    spectra = [r["spectrum"] for r in rows.values()]
    mean_spectrum = [statistics.fmean(s[i] for s in spectra) for i in range(len(spectra[0]))]
    return {"ffn_r_eff": r_eff, "ffn_r_eff_mean": statistics.fmean(r_eff), "ffn_spectrum": mean_spectrum}


def measure(args: Any, torchrun_args: Sequence[str]) -> Dict[str, Any]:
    from nanotron_ext.config.loader import load_config

    gpu = args.preset == "gpu"
    d = 4096 if gpu else load_config(CPU_CONFIG, args.set).model.hidden_size
    hs = GPU_H if gpu else {r: nearest_h(d, r) for r in PAPER_RATIOS}
    extra = [*args.set, *(presets.gpu_overrides(args) if gpu else [*CPU_COMMON, f"tokens.train_steps={args.steps}"])]
    runs = {row: (cfg, [*ovr, *extra]) for row, (cfg, ovr) in variants(hs, gpu).items()
            if row in args.rows or not args.rows}
    if args.dry_run:
        return {"dry_run": presets.dry_run(presets.runs_for_seeds(runs, args.seeds))}
    rows = []
    for seed in args.seeds:
        for row, (cfg, ovr) in runs.items():
            s = run_training(cfg, [*ovr, f"general.seed={seed}"], f"{row}_s{seed}", root=Path("runs/resbm_fig2"),
                             torchrun_args=torchrun_args, reuse=True, timeout_s=6 * 3600)
            r = {"row": row, "seed": seed, **describe(row, hs, d), "final_val_loss": s["final_val_loss"],
                 "train_losses": train_losses(Path(s["run_dir"])), "tokens_per_s": s.get("tokens_per_s")}
            if row.startswith("baseline"):
                r.update(ffn_spectra(s))
            rows.append(r)
            print(f"{row:<18} seed {seed}: val loss {r['final_val_loss']:.4f}"
                  + (f", FFN r_eff {r['ffn_r_eff_mean']:.2f}" if "ffn_r_eff_mean" in r else ""), flush=True)
    meta = br.run_meta({"config": CPU_CONFIG if not gpu else "reproduce/resbm/resbm_2b_*.yaml", "d": d, "h": hs,
                        "steps": None if gpu else args.steps, "preset": args.preset, "seeds": args.seeds,
                        "command": "python reproduce/resbm/fig2_vs_sm.py " + " ".join(args.argv)})
    return {"meta": meta, "rows": rows}


def comparisons(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Same-seed differences (a - b) of the final validation loss, and the Muon / AdamW ratio of the FFN
    effective rank, mean +- s.e. over seeds."""
    val = {(r["row"], r["seed"]): r["final_val_loss"] for r in rows}
    rank = {(r["row"], r["seed"]): r["ffn_r_eff_mean"] for r in rows if "ffn_r_eff_mean" in r}
    seeds = sorted({r["seed"] for r in rows})
    ratios = sorted({r["paper_ratio"] for r in rows if r["paper_ratio"]})
    pairs = [(f"resbm_{o}_{x}x", f"sm_{o}_{x}x") for x in ratios for o in ("adamw", "muon")]
    pairs += [(f"resbm_muon_{x}x", f"resbm_adamw_{x}x") for x in ratios]
    pairs += [(f"sm_muon_{x}x", f"sm_adamw_{x}x") for x in ratios]
    pairs += [(f"resbm_muon_{x}x", "baseline_adamw") for x in ratios]
    pairs += [("baseline_muon", "baseline_adamw")]
    out = []
    for a, b in pairs:
        value, err = mean_se([val[a, s] - val[b, s] for s in seeds if (a, s) in val and (b, s) in val])
        out.append({"key": f"{a} - {b}", "value": value, "err": err})
    value, err = mean_se([rank["baseline_muon", s] / rank["baseline_adamw", s] for s in seeds
                          if ("baseline_muon", s) in rank and ("baseline_adamw", s) in rank])
    out.append({"key": "ffn r_eff muon / adamw", "value": value, "err": err})
    return out


def claims(rows: List[Dict[str, Any]]) -> List[PaperClaim]:
    hs = {r["paper_ratio"]: r for r in rows if r["paper_ratio"]}
    kw = dict(column="value", paper=None, err_column="err", setting="2B, C4, 1 GPU")
    out = []
    for x, r in sorted(hs.items()):
        ours = f"ours h={r['h']}, {r['ratio']:.0f}x"
        for o in ("adamw", "muon"):
            out.append(PaperClaim(f"{x}x ({ours}), {o}: ResBM minus SM, val loss", relation="<", than=0.0,
                                  where={"key": f"resbm_{o}_{x}x - sm_{o}_{x}x"}, source="Fig. 2", **kw))
        out.append(PaperClaim(f"{x}x ({ours}): ResBM-Muon minus ResBM-AdamW, val loss", relation="<", than=0.0,
                              where={"key": f"resbm_muon_{x}x - resbm_adamw_{x}x"}, source="Fig. 2 / sec. 4.2", **kw))
        out.append(PaperClaim(f"{x}x ({ours}): SM-Muon minus SM-AdamW, val loss (not claimed)", relation=None,
                              where={"key": f"sm_muon_{x}x - sm_adamw_{x}x"}, source="Fig. 2", **kw))
    out.append(PaperClaim("baseline Muon minus baseline AdamW, val loss", relation="<", than=0.0,
                          where={"key": "baseline_muon - baseline_adamw"}, source="Fig. C.2", **kw))
    out.append(PaperClaim("FFN output projections, layer-mean effective rank, Muon / AdamW baseline", relation=">",
                          than=1.0, where={"key": "ffn r_eff muon / adamw"}, source="Fig. 1 / sec. 3.4", **kw))
    return out


def render(saved: Dict[str, Any]) -> Dict[str, Any]:
    rows = saved["rows"]
    comps = comparisons(rows)
    order = list(dict.fromkeys(r["row"] for r in rows))
    headers = ["row", "design", "optimiser", "h (ratio)", "seeds", "val loss (mean +- s.e.)", "per seed",
               "FFN r_eff (layer mean)"]
    body = []
    for name in order:
        mine = [r for r in rows if r["row"] == name]
        m, e = mean_se([r["final_val_loss"] for r in mine])
        rank = mean_se([r["ffn_r_eff_mean"] for r in mine if "ffn_r_eff_mean" in r])[0]
        r0 = mine[0]
        body.append([name, r0["design"], r0["optimizer"], f"{r0['h']} ({r0['ratio']:.0f}x)", len(mine),
                     f"{m:.4f}" + ("" if e is None else f" +- {e:.4f}"),
                     ", ".join(f"{r['final_val_loss']:.4f}" for r in mine),
                     "-" if rank is None else f"{rank:.2f}"])
    notes = ["The paper gives curves, not numbers: each verdict is an ordering of same-seed differences (2 s.e.)."]
    return {"headers": headers, "body": body, "verdicts": evaluate(claims(rows), comps), "figure": _plot(rows),
            "notes": notes, "extra": {"comparisons": comps}}


def _smooth(losses: List[float], k: int = 10) -> List[float]:
    return [statistics.fmean(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]


def _mean_curve(rows: List[Dict[str, Any]], name: str) -> Optional[List[float]]:
    curves = [r["train_losses"] for r in rows if r["row"] == name]
    if not curves:
        return None
    n = min(len(c) for c in curves)
    return _smooth([statistics.fmean(c[i] for c in curves) for i in range(n)])


def _plot(rows: List[Dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    ratios = sorted({r["paper_ratio"] for r in rows if r["paper_ratio"]})
    fig, axes = plt.subplots(1, len(ratios) + 2, figsize=(5 * (len(ratios) + 2), 4.2), squeeze=False)
    axes = axes[0]
    style = {("ResBM", "muon"): ("tab:green", "-"), ("ResBM", "adamw"): ("tab:green", "--"),
             ("SM", "muon"): ("tab:purple", "-"), ("SM", "adamw"): ("tab:purple", "--"),
             ("baseline", "adamw"): ("k", "--"), ("baseline", "muon"): ("k", "-")}
    for ax, x in zip(axes, ratios):
        for name in dict.fromkeys(r["row"] for r in rows):
            r0 = next(r for r in rows if r["row"] == name)
            if r0["paper_ratio"] not in (x, None):
                continue
            curve = _mean_curve(rows, name)
            colour, ls = style[r0["design"], r0["optimizer"]]
            ax.plot(range(1, len(curve) + 1), curve, ls, color=colour, lw=1.2,
                    label=f"{r0['design']} {r0['optimizer']}")
        ax.set(title=f"Fig. 2: paper {x}x (ours h = {next(r['h'] for r in rows if r['paper_ratio'] == x)})",
               xlabel="step", ylabel="train loss (10-step mean, mean over seeds)")
        ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
    ax = axes[len(ratios)]
    for name in ("baseline_adamw", "baseline_muon"):
        curve = _mean_curve(rows, name)
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, style["baseline", name.split("_")[1]][1], color="k", label=name)
    ax.set(title="Fig. C.2: baselines", xlabel="step", ylabel="train loss (10-step mean)")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.legend(fontsize=7)
    ax = axes[-1]
    for name, colour in (("baseline_adamw", "tab:orange"), ("baseline_muon", "tab:blue")):
        spectra = [r["ffn_spectrum"] for r in rows if r["row"] == name and "ffn_spectrum" in r]
        if spectra:
            mean = [statistics.fmean(s[i] for s in spectra) for i in range(len(spectra[0]))]
            ax.plot(range(1, len(mean) + 1), mean, color=colour, label=name.replace("baseline_", ""))
    ax.set(title="Fig. 1: FFN output projections", xlabel="singular value index",
           ylabel="s_i / s_1 (mean over layers, seeds)",
           yscale="log")
    ax.legend(fontsize=7)
    return fig


def build_parser() -> Any:
    p = br.script_parser(__doc__, "runs/resbm/fig2_vs_sm.json")
    rows = list(variants(dict.fromkeys(PAPER_RATIOS, 1), False))  # (a typo ran nothing, silently)
    p.add_argument("--steps", type=Int(1), default=150, help="CPU preset: training steps per run")
    p.add_argument("--rows", nargs="*", default=[], choices=rows, help="run only these rows (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config overrides for every run")
    presets.add_preset_args(p, "the 2B configs resbm_2b_*.yaml (SM rows: the baseline with k = 40 / 32) on one 80 GB "
                               "GPU", seeds=(42, 43, 44))
    return br.help_with_defaults(p)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    return presets.script_main(argv, build_parser, measure, render, TITLE)


if __name__ == "__main__":
    raise SystemExit(main())
