"""BOOST Figure 6 at the scale of this machine: average iteration time of full-rank Megatron TP,
vanilla low-rank TP and BOOST (btp)

    (left)   weak scaling: the model grows with the TP size (d = --base-hidden x tp; the paper:
             1B on 1 GPU ... 7B on 4 GPUs)
    (middle) micro-batch sizes (--batches) at the largest TP (paper: 7B, TP 4, bz 1..8)
    (right)  low-rank architectures svd / cola / lax at the largest TP (paper: 7B, TP 4)

    python reproduce/boost/fig6_scaling.py [--tp-sizes 1,2] [--out runs/boost/fig6_cpu.png] [-- extra torchrun args]

Every point is the mean (+- std) of --iters training iterations after --warmup, timed by the
iteration-compare worker (reproduce/boost/iter_compare.py, interleaved mode: all variants of a
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import Int, Names, NumberList, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

ITER_WORKER = Path(__file__).resolve().parent / "iter_compare.py"
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
    return bl.run_job(ITER_WORKER, cfgs, ["--mode", "interleaved", "--iters", str(args.iters), "--warmup",
                                          str(args.warmup)], ["--nproc_per_node", str(nproc), *args.torchrun_extra],
                      log_dir, args.timeout, args.verbose)


def points(result: Dict[str, Any], warmup: int) -> Dict[str, bt.Summary]:
    return {r["name"]: bt.summarize(r["times"], warmup) for r in result["rows"]}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_extra = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", default=default_tp_sizes(), type=NumberList(1),
                   help="TP sizes of the left panel (default: %(default)s)")
    p.add_argument("--base-hidden", type=Int(1), default=128, help="d at TP 1; d = base x tp (default 128)")
    p.add_argument("--layers", type=Int(1), default=4)
    p.add_argument("--seq", type=Int(1), default=256)
    p.add_argument("--micro-batch", type=Int(1), default=2, help="micro-batch of the left and right panels")
    p.add_argument("--batches", default="1,2,4,8", type=NumberList(1), help="micro-batch sizes of the middle panel")
    p.add_argument("--kinds", default="svd,cola,lax", type=Names(("svd", "cola", "lax")),
                   help="low-rank architectures of the right panel")
    bl.add_run_args(p, iters=8, warmup=2, out="runs/boost/fig6_scaling.png",
                    out_help="PNG path (JSON and markdown go beside it)", worker=False)
    br.help_with_defaults(p)
    args = p.parse_args(own)
    args.torchrun_extra = torchrun_extra
    if args.from_json:
        saved = br.read_saved(args.from_json)
        return publish(saved["rows"], saved["meta"], args.out)
    strategies = bw.require_strategies(["megatron", "vanilla", "btp"])
    tps = [int(t) for t in args.tp_sizes.split(",")]
    tp_max, d_max = max(tps), args.base_hidden * max(tps)

    def cfg(strategy: str, d: int, mb: int, kind: str = "cola") -> Any:
        heads = max(4, d // 64)
        return bw.resolve_config(None, [
            f"model.hidden_size={d}", f"model.ffn_size={ffn_for(d)}", f"model.num_layers={args.layers}",
            f"model.num_heads={heads}", f"model.num_kv_heads={heads}", f"model.max_seq_len={args.seq}",
            f"tokens.sequence_length={args.seq}", f"tokens.micro_batch_size={mb}",
            "tokens.batch_accumulation_per_replica=1"] + bc.strategy_overrides(strategy, kind))

    rows: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {}
    for tp in tps:
        d = args.base_hidden * tp
        res = panel_job(args, {s: cfg(s, d, args.micro_batch) for s in strategies}, tp, f"left_tp{tp}")
        meta = res["meta"]
        pts = points(res, args.warmup)
        for s in strategies:
            rows.append({"panel": "left", "tp": tp, "hidden": d, "strategy": s, "mean_s": pts[s].mean,
                         "std_s": pts[s].std})
    batches = [int(b) for b in args.batches.split(",")]
    res = panel_job(args, {f"{s}@{mb}": cfg(s, d_max, mb) for s in strategies for mb in batches}, tp_max, "middle")
    pts = points(res, args.warmup)
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

    meta = {**meta, "iters": args.iters, "warmup": args.warmup, "layers": args.layers, "seq": args.seq,
            "micro_batch": args.micro_batch, "base_hidden": args.base_hidden}
    return publish(rows, meta, args.out)


def _n(meta: Dict[str, Any]) -> int:
    return int(meta.get("iters", 2)) - int(meta.get("warmup", 0))


def add_speedups(rows: Sequence[Dict[str, Any]], n: int) -> None:
    """Each row's speedup over the megatron and the vanilla row of the same point (panel, TP,
    micro-batch; the same low-rank kind, or the full-rank row of the right panel), +- s.e."""
    def summary(r: Dict[str, Any]) -> bt.Summary:
        return bt.Summary(n, r["mean_s"], r["std_s"], r["mean_s"], r["mean_s"], r["mean_s"])

    for r in rows:
        for ref in ("megatron", "vanilla"):
            cands = [c for c in rows if c["strategy"] == ref and c["panel"] == r["panel"] and c["tp"] == r["tp"]
                     and c.get("micro_batch") == r.get("micro_batch") and c.get("kind") in (r.get("kind"), "none")]
            cands.sort(key=lambda c: c.get("kind") != r.get("kind"))  # the same kind first
            sp = bt.speedup(summary(cands[0]), summary(r)) if cands else (None, None)
            r[f"speedup_vs_{ref}"], r[f"speedup_vs_{ref}_err"] = sp


def claims_for(rows: Sequence[Dict[str, Any]]) -> List[bp.PaperClaim]:
    """Figure 6's numbers at our points: TP=1 (the paper's 1B, no TP), the largest TP (up to 1.91x /
    2.28x), micro-batches 1, 2, 4 (1.3x, 1.42x, 1.48x over full rank) and every low-rank kind
    (1.5x over vanilla, 2.2x over full rank)."""
    left_tps = sorted({r["tp"] for r in rows if r["panel"] == "left"})
    out = []
    if 1 in left_tps:
        out.append(bp.PaperClaim("low rank (btp) vs full rank without TP", "speedup_vs_megatron", 1.4, ">", 1.0,
                                 where={"panel": "left", "tp": 1, "strategy": "btp"},
                                 err_column="speedup_vs_megatron_err",
                                 source="Fig. 6 (left)", setting="1B, 1 GPU"))
    if left_tps and left_tps[-1] > 1:
        at = {"panel": "left", "tp": left_tps[-1], "strategy": "btp"}
        out += [bp.PaperClaim(f"BOOST vs full rank, TP={left_tps[-1]}", "speedup_vs_megatron", 1.91, ">", 1.0, where=at,
                              err_column="speedup_vs_megatron_err", source="Fig. 6 (left)", setting="3B-30B, up to"),
                bp.PaperClaim(f"BOOST vs vanilla, TP={left_tps[-1]}", "speedup_vs_vanilla", 2.28, ">", 1.0, where=at,
                              err_column="speedup_vs_vanilla_err", source="Fig. 6 (left)", setting="3B-30B, up to")]
    for mb, value in ((1, 1.3), (2, 1.42), (4, 1.48)):
        out.append(bp.PaperClaim(f"BOOST vs full rank, bz={mb}", "speedup_vs_megatron", value, ">", 1.0,
                                 where={"panel": "middle", "micro_batch": mb, "strategy": "btp"},
                                 err_column="speedup_vs_megatron_err", source="Fig. 6 (middle)", setting="7B, TP=4"))
    for kind in [k for k in dict.fromkeys(r.get("kind") for r in rows if r["panel"] == "right")
                 if k not in (None, "none")]:
        at = {"panel": "right", "kind": kind, "strategy": "btp"}
        out += [bp.PaperClaim(f"BOOST vs vanilla, {kind}", "speedup_vs_vanilla", 1.5, ">", 1.0, where=at,
                              err_column="speedup_vs_vanilla_err", source="Fig. 6 (right)", setting="7B, TP=4"),
                bp.PaperClaim(f"BOOST vs full rank, {kind}", "speedup_vs_megatron", 2.2, ">", 1.0, where=at,
                              err_column="speedup_vs_megatron_err", source="Fig. 6 (right)", setting="7B, TP=4")]
    return out


def plot(rows: Sequence[Dict[str, Any]]) -> Any:
    """The three panels from the rows (so a saved result re-plots without measuring)."""
    fig, axes = br.new_figure(3)
    ms = 1e3
    strategies = [s for s in bc.DESIGNS if any(r["strategy"] == s for r in rows)]
    at = {(r["panel"], r["tp"], r.get("micro_batch"), r.get("kind"), r["strategy"]): r for r in rows}

    def bars(ax: Any, keys: List[tuple], labels: List[str], panel: str) -> None:
        series = {LABEL[s]: [at[(panel, *k, s)]["mean_s"] * ms if (panel, *k, s) in at else None for k in keys]
                  for s in strategies if panel != "right" or s != "megatron"}
        errs = {LABEL[s]: [at[(panel, *k, s)]["std_s"] * ms if (panel, *k, s) in at else None for k in keys]
                for s in strategies if panel != "right" or s != "megatron"}
        br.grouped_bars(ax, labels, series, errs, "iteration time (ms)", color=bc.design_color)

    left = sorted({(r["tp"], r["hidden"]) for r in rows if r["panel"] == "left"})
    bars(axes[0], [(tp, None, None) for tp, _ in left], [f"d={d}\nTP={tp}" for tp, d in left], "left")
    axes[0].set_title("model size with TP size")
    mid = [r for r in rows if r["panel"] == "middle"]
    if mid:
        tp, d = mid[0]["tp"], mid[0]["hidden"]
        batches = sorted({r["micro_batch"] for r in mid})
        bars(axes[1], [(tp, b, None) for b in batches], [f"bz={b}" for b in batches], "middle")
        axes[1].set_title(f"micro-batch size (d={d}, TP={tp})")
    right = [r for r in rows if r["panel"] == "right"]
    if right:
        tp, d = right[0]["tp"], right[0]["hidden"]
        kinds = [k for k in dict.fromkeys(r["kind"] for r in right) if k != "none"]
        bars(axes[2], [(tp, None, k) for k in kinds], kinds, "right")
        full = at.get(("right", tp, None, "none", "megatron"))
        if full is not None:
            axes[2].axhline(full["mean_s"] * ms, color="k", ls="--", lw=1, label=LABEL["megatron"])
        axes[2].set_title(f"low-rank architecture (d={d}, TP={tp})")
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: str) -> int:
    """Table with the paper's speedups beside ours, verdicts, and PNG + JSON + markdown at `out`."""
    add_speedups(rows, _n(meta))
    claims = claims_for(rows)
    bp.annotate(rows, claims)
    verdicts = bp.evaluate(claims, rows)
    headers = ["panel", "tp", "d", "bz / kind", "strategy", "iter ms mean +- std", "vs full rank", "paper",
               "vs vanilla", "paper"]
    body = [[r["panel"], r["tp"], r["hidden"], r.get("micro_batch", r.get("kind", meta.get("micro_batch"))),
             r["strategy"], f"{r['mean_s'] * 1e3:.1f} +- {r['std_s'] * 1e3:.1f}",
             br.fmt_x(r["speedup_vs_megatron"]), br.fmt_x(r.get("paper_speedup_vs_megatron")),
             br.fmt_x(r["speedup_vs_vanilla"]), br.fmt_x(r.get("paper_speedup_vs_vanilla"))] for r in rows]
    print(br.format_table(headers, body))
    print("\n".join(bp.verdict_lines(verdicts)))
    shape = f"{meta['layers']} layers, seq {meta['seq']}, " if "layers" in meta else ""
    title = f"BOOST Figure 6 at CPU scale: iteration time, {shape}mean +- std of {_n(meta)} iterations"
    written = br.write_report(Path(out).with_suffix(".json"), rows, meta, title, headers, body, verdicts=verdicts,
                              figure=plot(rows), notes=["paper: LLaMA 1B-30B on GPUs, bz 4, seq 4k "
                                                        "(speedups only compare)."])
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
