"""BOOST Figure 6 at the scale of this machine: average iteration time of full-rank Megatron TP,
vanilla low-rank TP and BOOST (btp)

    (left)   weak scaling: the model grows with the TP size (d = --base-hidden x tp; the paper:
             1B on 1 GPU ... 7B on 4 GPUs)
    (middle) micro-batch sizes (--batches) at the largest TP (paper: 7B, TP 4, bz 1..8)
    (right)  low-rank architectures svd / cola / lax at the largest TP (paper: 7B, TP 4)

    python benchmarks/boost_fig6_scaling.py [--tp-sizes 1,2] [--out runs/boost/fig6_cpu.png] [-- extra torchrun args]

Every point is the mean (+- std) of --iters training iterations after --warmup, timed by the
iteration-compare worker (benchmarks/boost_iter_compare.py, interleaved mode: all variants of a
panel in one torchrun job, iterations alternating). One job per TP size for the left panel, one
each for the middle and right panels. Default TP sizes: powers of two up to the CPU count (each
rank one thread); on GPUs pass e.g. --tp-sizes 1,2,4,8.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

ITER_WORKER = Path(__file__).resolve().parent / "boost_iter_compare.py"
LABEL = {"megatron": "FullRank-TP (megatron)", "vanilla": "Vanilla-TP", "btp": "BOOST (btp)"}


def default_tp_sizes() -> str:
    n, out = os.cpu_count() or 1, []
    t = 1
    while t <= n:
        out.append(str(t))
        t *= 2
    return ",".join(out)


def ffn_for(d: int) -> int:
    """LLaMA's SwiGLU width rule 8d/3, rounded up to a multiple of 16 (Table 8 sizes follow it
    to within its own rounding)."""
    return -(-(8 * d // 3) // 16) * 16


def panel_job(args: argparse.Namespace, cfgs: Dict[str, Any], nproc: int, tag: str) -> Dict[str, Any]:
    log_dir = str(Path(args.log_dir) / tag) if args.log_dir else None
    return bc.run_job(ITER_WORKER, cfgs, ["--mode", "interleaved", "--iters", str(args.iters), "--warmup",
                                          str(args.warmup)], ["--nproc_per_node", str(nproc), *args.torchrun_extra],
                      log_dir, args.timeout, args.verbose)


def points(result: Dict[str, Any], warmup: int) -> Dict[str, bc.Summary]:
    return {r["name"]: bc.summarize(r["times"], warmup) for r in result["rows"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_extra = bc.split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", default=default_tp_sizes(), help="TP sizes of the left panel (default: %(default)s)")
    p.add_argument("--base-hidden", type=int, default=128, help="d at TP 1; d = base x tp (default 128)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2, help="micro-batch of the left and right panels")
    p.add_argument("--batches", default="1,2,4,8", help="micro-batch sizes of the middle panel")
    p.add_argument("--kinds", default="svd,cola,lax", help="low-rank architectures of the right panel")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/boost/fig6_scaling.png", help="PNG path (the JSON goes beside it)")
    p.add_argument("--log-dir")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(own)
    args.torchrun_extra = torchrun_extra
    strategies = bc.require_strategies(["megatron", "vanilla", "btp"])
    tps = [int(t) for t in args.tp_sizes.split(",")]
    tp_max, d_max = max(tps), args.base_hidden * max(tps)

    def cfg(strategy: str, d: int, mb: int, kind: str = "cola") -> Any:
        heads = max(4, d // 64)
        return bc.resolve_config(None, [
            f"model.hidden_size={d}", f"model.ffn_size={ffn_for(d)}", f"model.num_layers={args.layers}",
            f"model.num_heads={heads}", f"model.num_kv_heads={heads}", f"model.max_seq_len={args.seq}",
            f"tokens.sequence_length={args.seq}", f"tokens.micro_batch_size={mb}",
            "tokens.batch_accumulation_per_replica=1"] + bc.strategy_overrides(strategy, kind))

    rows: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {}
    left: Dict[str, List[Optional[bc.Summary]]] = {s: [] for s in strategies}
    for tp in tps:
        d = args.base_hidden * tp
        res = panel_job(args, {s: cfg(s, d, args.micro_batch) for s in strategies}, tp, f"left_tp{tp}")
        meta = res["meta"]
        pts = points(res, args.warmup)
        for s in strategies:
            left[s].append(pts.get(s))
            rows.append({"panel": "left", "tp": tp, "hidden": d, "strategy": s, "mean_s": pts[s].mean, "std_s": pts[s].std})
    batches = [int(b) for b in args.batches.split(",")]
    res = panel_job(args, {f"{s}@{mb}": cfg(s, d_max, mb) for s in strategies for mb in batches}, tp_max, "middle")
    pts = points(res, args.warmup)
    mid = {s: [pts[f"{s}@{mb}"] for mb in batches] for s in strategies}
    rows += [{"panel": "middle", "tp": tp_max, "hidden": d_max, "micro_batch": mb, "strategy": s,
              "mean_s": pts[f"{s}@{mb}"].mean, "std_s": pts[f"{s}@{mb}"].std} for s in strategies for mb in batches]
    kinds = [k for k in args.kinds.split(",") if k]
    right_cfgs = {f"{s}@{k}": cfg(s, d_max, args.micro_batch, k) for s in strategies if s != "megatron" for k in kinds}
    if "megatron" in strategies:
        right_cfgs["megatron@none"] = cfg("megatron", d_max, args.micro_batch)
    res = panel_job(args, right_cfgs, tp_max, "right")
    pts = points(res, args.warmup)
    rows += [{"panel": "right", "tp": tp_max, "hidden": d_max, "kind": n.split("@")[1], "strategy": n.split("@")[0],
              "mean_s": v.mean, "std_s": v.std} for n, v in pts.items()]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ms = 1e3
    bc.grouped_bars(axes[0], [f"d={args.base_hidden * t}\nTP={t}" for t in tps],
                    {LABEL[s]: [x.mean * ms if x else None for x in left[s]] for s in strategies},
                    {LABEL[s]: [x.std * ms if x else None for x in left[s]] for s in strategies}, "iteration time (ms)")
    axes[0].set_title("model size with TP size")
    bc.grouped_bars(axes[1], [f"bz={b}" for b in batches],
                    {LABEL[s]: [x.mean * ms for x in mid[s]] for s in strategies},
                    {LABEL[s]: [x.std * ms for x in mid[s]] for s in strategies}, "iteration time (ms)")
    axes[1].set_title(f"micro-batch size (d={d_max}, TP={tp_max})")
    groups = kinds
    right = {LABEL[s]: [pts[f"{s}@{k}"].mean * ms if f"{s}@{k}" in pts else None for k in groups]
             for s in strategies if s != "megatron"}
    right_err = {LABEL[s]: [pts[f"{s}@{k}"].std * ms if f"{s}@{k}" in pts else None for k in groups]
                 for s in strategies if s != "megatron"}
    bc.grouped_bars(axes[2], groups, right, right_err, "iteration time (ms)")
    if "megatron@none" in pts:
        axes[2].axhline(pts["megatron@none"].mean * ms, color="k", ls="--", lw=1, label=LABEL["megatron"])
    axes[2].set_title(f"low-rank architecture (d={d_max}, TP={tp_max})")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(bc.figure_title(f"BOOST Figure 6 at CPU scale: iteration time, {args.layers} layers, seq {args.seq}, "
                                 f"mean +- std of {args.iters - args.warmup} iterations", meta), fontsize=10)
    png, js = bc.save_figure(fig, args.out, rows, {**meta, "iters": args.iters, "warmup": args.warmup})
    print(bc.format_table(["panel", "tp", "d", "bz / kind", "strategy", "iter ms mean +- std"],
                          [[r["panel"], r["tp"], r["hidden"], r.get("micro_batch", r.get("kind", args.micro_batch)),
                            r["strategy"], f"{r['mean_s'] * 1e3:.1f} +- {r['std_s'] * 1e3:.1f}"] for r in rows]))
    print(f"wrote {png} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
