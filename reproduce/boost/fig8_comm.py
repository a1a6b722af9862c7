"""BOOST Figure 8 at the scale of this machine: TP communication of one decoder block, and Figure 1 (middle)
from the same runs.

    (1) TP volume (forward + backward, ledger) and time inside collectives per strategy
    (2) the same against the micro-batch size
    (3) Online vs Sync RMSNorm under btp: time inside collectives, the rest of the block
        (compute), and collective calls
    (4) Figure 1 (middle): the block's runtime split into collectives and the rest per strategy at the
        first micro-batch size (paper: full rank under 20% in collectives on 4 GPUs, vanilla low rank an
        "explosion" of communication overhead, no number)

    python reproduce/boost/fig8_comm.py [--batches 1,2,4,8] [--out runs/boost/fig8_cpu.png] [-- torchrun args]

One torchrun job (default 2 CPU ranks, TP=2) runs the Table 3 worker (reproduce/boost/table3_grouping.py)
on full-rank Megatron, vanilla low-rank and btp with Online and Sync RMSNorm: forward+backward of
the first decoder block (in the Table 3 worker's precision: model.dtype bf16 times bf16 weights and inputs),
iterations interleaved. Block times come from iterations without the profiler; the time in collectives
(gloo events on CPU, NCCL kernels on GPU) from separate iterations under torch.profiler, interleaved the
same way; compute = mean block time - mean time in collectives (its standard error propagated).
Results whose meta lacks "totals": "unprofiled" (committed before this method) timed the blocks under the profiler.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import NumberList, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402
from reproduce.boost import table3_grouping as t3  # noqa: E402

BLOCK_WORKER = Path(t3.__file__).resolve()
VARIANTS = {"FullRank-TP (megatron)": ("megatron", None), "Vanilla-TP": ("vanilla", None),
            "BOOST btp (online RMSNorm)": ("btp", "online"), "BOOST btp (sync RMSNorm)": ("btp", "sync")}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bw.add_model_args(p)
    p.add_argument("--batches", default="1,2,4,8", type=NumberList(1), help="micro-batch sizes (left panel: the first)")
    bl.add_run_args(p, iters=10, warmup=2, out="runs/boost/fig8_comm.png",
                    out_help="PNG path (JSON and markdown go beside it)", worker=False)
    br.help_with_defaults(p)
    args = p.parse_args(own)
    if args.from_json:
        saved = br.read_saved(args.from_json)
        return publish(saved["rows"], saved["meta"], args.out)
    registered = bw.require_strategies(["megatron", "vanilla", "btp"])
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {name: bw.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind, mode))
            for name, (s, mode) in VARIANTS.items() if s in registered}
    result = bl.run_job(BLOCK_WORKER, cfgs, ["--batches", args.batches, "--iters", str(args.iters), "--warmup",
                                             str(args.warmup)], torchrun_args, args.log_dir, args.timeout, args.verbose)
    meta = result["meta"]
    rows: List[Dict[str, Any]] = []
    for r in result["rows"]:
        if r["part"] != "block":
            continue
        wall = bt.summarize(r["times"], args.warmup)  # unprofiled iterations
        comm = bt.summarize(r["comm_s"], args.warmup)  # separate profiled iterations
        rest = bt.difference(wall, comm)
        rows.append({"variant": r["variant"], "micro_batch": r["micro_batch"], "tp_bytes_fwd_bwd": r["tp_bytes"],
                     "tp_calls_fwd_bwd": r["tp_calls"], "block_s": wall.mean, "block_std_s": wall.std,
                     "comm_s": comm.mean, "comm_std_s": comm.std, "compute_s": rest[0], "compute_err_s": rest[1],
                     "profiled_block_s": bt.summarize(r["profiled_times"], args.warmup).mean})
    meta = {**meta, "low_rank_kind": kind, "iters": args.iters, "warmup": args.warmup, "totals": t3.TOTALS,
            "precision": bw.precision_label(next(iter(cfgs.values())), bc.PRECISION)}
    return publish(rows, meta, args.out)


def add_ratios(rows: Sequence[Dict[str, Any]]) -> None:
    """Per micro-batch: each variant's TP volume over full rank's and vanilla's, full rank's and
    vanilla's time in collectives over this variant's (> 1: less time), and the online row's time in
    collectives over the sync row's; each row's share of its block time spent in collectives (Fig. 1 middle)
    and that share over full rank's and vanilla's."""
    by = {(r["variant"], r["micro_batch"]): r for r in rows}
    full, van, online, sync = (n for n in VARIANTS)
    for r in rows:  # first every row's own share: the ratios below read full rank's and vanilla's
        r["comm_share"] = bc.ratio(r["comm_s"], r["block_s"])
    for r in rows:
        mb = r["micro_batch"]
        f, v, sy = by.get((full, mb)), by.get((van, mb)), by.get((sync, mb))
        r["bytes_vs_megatron"] = bc.ratio(r["tp_bytes_fwd_bwd"], f["tp_bytes_fwd_bwd"]) if f else None
        r["bytes_vs_vanilla"] = bc.ratio(r["tp_bytes_fwd_bwd"], v["tp_bytes_fwd_bwd"]) if v else None
        r["comm_speedup_vs_megatron"] = bc.ratio(f["comm_s"], r["comm_s"]) if f else None
        r["comm_speedup_vs_vanilla"] = bc.ratio(v["comm_s"], r["comm_s"]) if v else None
        r["comm_vs_sync"] = bc.ratio(r["comm_s"], sy["comm_s"]) if sy and r["variant"] == online else None
        r["comm_share_vs_megatron"] = bc.ratio(r["comm_share"], f["comm_share"]) if f else None
        r["comm_share_vs_vanilla"] = bc.ratio(r["comm_share"], v["comm_share"]) if v else None


def claims_for(rows: Sequence[Dict[str, Any]]) -> List[bp.PaperClaim]:
    """Figure 8 at each micro-batch we measured: BOOST's TP volume below full rank's (Table 6: 7r/2d
    = 0.875 at r = d/4) and far below vanilla's (7B: 7r / (5d + 2 d_ff) = 0.169), its time in
    collectives up to 8% below full rank's and 5.3x below vanilla's; Online RMSNorm spends less time in
    collectives than Sync (right panel, no number). Figure 1 (middle), at the first micro-batch size: full
    rank spends under 20% of the block in collectives, vanilla low rank a larger share ("an explosion in the
    communication overhead", no number), BOOST a smaller share than vanilla."""
    full, vanilla, online, _ = VARIANTS
    mb0 = min(r["micro_batch"] for r in rows)
    fig1 = dict(source="Fig. 1 (middle)", setting="full-rank vs low-rank decoder block, 4 GPUs, one node")
    out = [bp.PaperClaim(f"full rank's time in collectives / block time, bz={mb0}", "comm_share", 0.2, "<", 0.2,
                         where={"variant": full, "micro_batch": mb0}, **fig1),
           bp.PaperClaim(f"vanilla low rank's collective share / full rank's, bz={mb0}", "comm_share_vs_megatron", None,
                         ">", 1.0, where={"variant": vanilla, "micro_batch": mb0}, **fig1),
           bp.PaperClaim(f"BOOST's collective share / vanilla's, bz={mb0}", "comm_share_vs_vanilla", None, "<", 1.0,
                         where={"variant": online, "micro_batch": mb0}, **fig1)]
    for mb in sorted({r["micro_batch"] for r in rows}):
        at = {"variant": online, "micro_batch": mb}
        out += [
            bp.PaperClaim(f"BOOST TP volume / full rank's, bz={mb}", "bytes_vs_megatron", 7 / 8, "<", 1.0,
                          where=at, exact=True,
                          source="Fig. 8 (left, middle); Table 6", setting="r = d/4"),
            bp.PaperClaim(f"BOOST TP volume / vanilla's, bz={mb}", "bytes_vs_vanilla",
                          7 * 1024 / (5 * 4096 + 2 * 11008),
                          "<", 1.0, where=at, exact=True, source="Fig. 8 (left, middle); Table 6",
                          setting="LLaMA-7B shapes"),
            bp.PaperClaim(f"full rank's comm time / BOOST's, bz={mb}", "comm_speedup_vs_megatron", 1.08, ">", 1.0,
                          where=at, source="Fig. 8 (left, middle)", setting="7B/13B, GPU, up to"),
            bp.PaperClaim(f"vanilla's comm time / BOOST's, bz={mb}", "comm_speedup_vs_vanilla", 5.3, ">", 1.0,
                          where=at, source="Fig. 8 (left, middle)", setting="7B/13B, GPU"),
            bp.PaperClaim(f"Online / Sync RMSNorm comm time, bz={mb}", "comm_vs_sync", None, "<", 1.0, where=at,
                          source="Fig. 8 (right)", setting="7B/13B, GPU"),
        ]
    return out


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: str) -> int:
    """Table with ratios beside the paper's, verdicts, PNG + JSON + markdown at `out`."""
    add_ratios(rows)
    claims = claims_for(rows)
    bp.annotate(rows, claims)
    verdicts = bp.evaluate(claims, rows)
    headers = ["variant", "bz", "TP KiB fwd+bwd", "TP calls", "block ms", "comm ms", "compute ms",
               "comm share", "volume / full",
               "paper", "volume / vanilla", "paper", "comm x vs full", "paper", "comm x vs vanilla", "paper"]
    body = [[r["variant"], r["micro_batch"], br.fmt_bytes(r["tp_bytes_fwd_bwd"]), r["tp_calls_fwd_bwd"],
             f"{r['block_s'] * 1e3:.1f} +- {r['block_std_s'] * 1e3:.1f}", f"{r['comm_s'] * 1e3:.1f}",
             f"{r['compute_s'] * 1e3:.1f}", f"{r['comm_share']:.0%}"] + [
             br.fmt_x(r.get(k), 3 if k.startswith("bytes") else 2) for col in
             ("bytes_vs_megatron", "bytes_vs_vanilla", "comm_speedup_vs_megatron", "comm_speedup_vs_vanilla")
             for k in (col, f"paper_{col}")] for r in rows]
    print(br.format_table(headers, body))
    print("\n".join(bp.verdict_lines(verdicts)))
    title = ("BOOST Figures 8 and 1 (middle) at CPU scale: TP communication of one decoder block, "
             f"TP={meta.get('tp')}, mean of {int(meta.get('iters', 0)) - int(meta.get('warmup', 0))} iterations")
    written = br.write_report(Path(out).with_suffix(".json"), rows, meta, title, headers, body, verdicts=verdicts,
                              figure=plot(rows), notes=["paper: 7B/13B on GPUs; volumes are the ledger's, fwd+bwd.",
                                                        "block = total, compute = comp: " + t3.method_note(meta)])
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


def plot(rows: Sequence[Dict[str, Any]]) -> Any:
    """The four panels from the rows."""
    names = [n for n in VARIANTS if any(r["variant"] == n for r in rows)]
    batches = sorted({r["micro_batch"] for r in rows})
    at = {(r["variant"], r["micro_batch"]): r for r in rows}
    fig, axes = br.new_figure(4, width=16 / 3)
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
        ax.bar(xs, rest_ms, width, bottom=comm_ms, color=bc.design_color(n), alpha=0.35,
               label=f"{mode}: rest (compute)")
        for x, b, c in zip(xs, batches, comm_ms):
            ax.annotate(f"{at[(n, b)]['tp_calls_fwd_bwd']} calls", (x, c / 2), fontsize=6, ha="center", va="center",
                        rotation=90)
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels([f"bz={b}" for b in batches])
    ax.set_ylabel("ms per block fwd+bwd")
    ax.legend(fontsize=7)
    ax.set_title("btp: Online vs Sync RMSNorm")
    ax = axes[3]  # Fig. 1 (middle): stacked time in collectives and the rest, one bar per strategy
    comm_ms = [at[(n, mb0)]["comm_s"] * 1e3 for n in names]
    rest_ms = [at[(n, mb0)]["compute_s"] * 1e3 for n in names]
    colors = [bc.design_color(n) for n in names]
    ax.bar(range(len(names)), comm_ms, color=colors)
    ax.bar(range(len(names)), rest_ms, bottom=comm_ms, color=colors, alpha=0.35)
    ax.bar([], [], color="grey", label="in collectives")  # legend entries in a neutral colour
    ax.bar([], [], color="grey", alpha=0.35, label="rest (compute)")
    for i, n in enumerate(names):
        ax.annotate(f"{at[(n, mb0)]['comm_share']:.0%}", (i, comm_ms[i] / 2), fontsize=7, ha="center", va="center")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_ylabel("ms per block fwd+bwd")
    ax.legend(fontsize=7)
    ax.set_title(f"Fig. 1 (middle): runtime breakdown (bz={mb0})")
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
