"""BOOST Figure 8 at the scale of this machine: TP communication of one decoder block.

    (left)   TP volume (forward + backward, ledger) and time inside collectives per strategy
    (middle) the same against the micro-batch size
    (right)  Online vs Sync RMSNorm under btp: time inside collectives, the rest of the block
             (compute), and collective calls

    python benchmarks/boost_fig8_comm.py [--batches 1,2,4,8] [--out runs/boost/fig8_cpu.png] [-- torchrun args]

One torchrun job (default 2 CPU ranks, TP=2) runs the Table 3 worker (benchmarks/boost_table3_grouping.py)
on full-rank Megatron, vanilla low-rank and btp with Online and Sync RMSNorm: forward+backward of
the first decoder block, iterations interleaved, each under torch.profiler (started outside the
timed window) to split the collectives' time (gloo events on CPU, NCCL kernels on GPU) from the rest.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

BLOCK_WORKER = Path(__file__).resolve().parent / "boost_table3_grouping.py"
VARIANTS = {"FullRank-TP (megatron)": ("megatron", None), "Vanilla-TP": ("vanilla", None),
            "BOOST btp (online RMSNorm)": ("btp", "online"), "BOOST btp (sync RMSNorm)": ("btp", "sync")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bc.split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    p.add_argument("--batches", default="1,2,4,8", help="micro-batch sizes (left panel: the first)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/boost/fig8_comm.png", help="PNG path (the JSON goes beside it)")
    p.add_argument("--log-dir")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(own)
    registered = bc.require_strategies(["megatron", "vanilla", "btp"])
    shared = bc.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {name: bc.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind, mode))
            for name, (s, mode) in VARIANTS.items() if s in registered}
    result = bc.run_job(BLOCK_WORKER, cfgs, ["--batches", args.batches, "--iters", str(args.iters), "--warmup",
                                             str(args.warmup)], torchrun_args, args.log_dir, args.timeout, args.verbose)
    meta = result["meta"]
    rows: List[Dict[str, Any]] = []
    for r in result["rows"]:
        if r["part"] != "block":
            continue
        wall = bc.summarize(r["times"], args.warmup)
        comm = bc.summarize(r["comm_s"], args.warmup)
        rest = bc.summarize([w - c for w, c in zip(r["times"], r["comm_s"])], args.warmup)
        rows.append({"variant": r["variant"], "micro_batch": r["micro_batch"], "tp_bytes_fwd_bwd": r["tp_bytes"],
                     "tp_calls_fwd_bwd": r["tp_calls"], "block_s": wall.mean, "block_std_s": wall.std,
                     "comm_s": comm.mean, "comm_std_s": comm.std, "compute_s": rest.mean, "compute_std_s": rest.std})
    names = [n for n in VARIANTS if n in cfgs]
    batches = [int(b) for b in args.batches.split(",")]
    at = {(r["variant"], r["micro_batch"]): r for r in rows}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    mb0 = batches[0]
    ax = axes[0]
    kib = [at[(n, mb0)]["tp_bytes_fwd_bwd"] / 2**10 for n in names]
    ax.bar(range(len(names)), kib, color=[bc.design_color(n) for n in names])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_ylabel("TP volume per block, fwd+bwd (KiB)")
    tw = ax.twinx()
    tw.errorbar(range(len(names)), [at[(n, mb0)]["comm_s"] * 1e3 for n in names],
                yerr=[at[(n, mb0)]["comm_std_s"] * 1e3 for n in names], fmt="kD", label="comm time")
    tw.set_ylabel("time in collectives (ms)")
    tw.legend(fontsize=7, loc="upper right")
    ax.set_title(f"per strategy (bz={mb0})")
    ax = axes[1]
    for n in names:
        ax.plot(batches, [at[(n, b)]["tp_bytes_fwd_bwd"] / 2**20 for b in batches], "o-", label=f"{n} volume",
                color=bc.design_color(n))
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("TP volume per block, fwd+bwd (MiB)")
    tw = ax.twinx()
    for n in names:
        tw.errorbar(batches, [at[(n, b)]["comm_s"] * 1e3 for b in batches],
                    yerr=[at[(n, b)]["comm_std_s"] * 1e3 for b in batches], fmt="--", color=bc.design_color(n))
    tw.set_ylabel("time in collectives (ms, dashed)")
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title("against micro-batch size")
    ax = axes[2]
    norm = [n for n in names if "RMSNorm" in n]
    width = 0.8 / max(1, len(norm))
    for i, n in enumerate(norm):  # stacked: time in collectives, then the rest of the block
        xs = [g + (i - (len(norm) - 1) / 2) * width for g in range(len(batches))]
        comm_ms = [at[(n, b)]["comm_s"] * 1e3 for b in batches]
        rest_ms = [at[(n, b)]["compute_s"] * 1e3 for b in batches]
        mode = n.split("(")[1].split()[0]
        ax.bar(xs, comm_ms, width, color=bc.design_color(n), label=f"{mode}: in collectives")
        ax.bar(xs, rest_ms, width, bottom=comm_ms, color=bc.design_color(n), alpha=0.35, label=f"{mode}: rest (compute)")
        for x, b, c in zip(xs, batches, comm_ms):
            ax.annotate(f"{at[(n, b)]['tp_calls_fwd_bwd']} calls", (x, c / 2), fontsize=6, ha="center", va="center",
                        rotation=90)
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels([f"bz={b}" for b in batches])
    ax.set_ylabel("ms per block fwd+bwd")
    ax.legend(fontsize=7)
    ax.set_title("btp: Online vs Sync RMSNorm")
    fig.suptitle(bc.figure_title(f"BOOST Figure 8 at CPU scale: TP communication of one decoder block, "
                                 f"TP={meta.get('tp')}, mean of {args.iters - args.warmup} iterations", meta), fontsize=10)
    png, js = bc.save_figure(fig, args.out, rows, {**meta, "low_rank_kind": kind, "iters": args.iters,
                                                   "warmup": args.warmup})
    headers = ["variant", "bz", "TP KiB fwd+bwd", "TP calls", "block ms", "comm ms", "compute ms"]
    print(bc.format_table(headers, [[r["variant"], r["micro_batch"], bc.fmt_bytes(r["tp_bytes_fwd_bwd"]),
                                     r["tp_calls_fwd_bwd"], f"{r['block_s'] * 1e3:.1f} +- {r['block_std_s'] * 1e3:.1f}",
                                     f"{r['comm_s'] * 1e3:.1f}", f"{r['compute_s'] * 1e3:.1f}"] for r in rows]))
    print(f"wrote {png} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
