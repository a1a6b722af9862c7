"""BOOST Figure 7 at the scale of this machine: computation efficiency of each linear layer.

    (left)   forward GEMM work (FLOPs) and GEMM time per linear (QKV, O, gate/up, down) for
             full-rank Megatron TP, vanilla low-rank TP and btp
    (middle) hardware utilisation of each linear, vanilla vs btp (and full rank)
    (right)  utilisation against the micro-batch size

    python reproduce/boost/fig7_compute.py [--batches 1,2,4,8] [--out runs/boost/fig7_cpu.png] [-- torchrun args]

One torchrun job (default 2 CPU ranks, TP=2) builds each model and takes the GEMM shapes from this
rank's actual weight shards of the first decoder block (so each design's split is exactly what
the strategy builds). Every weight's forward GEMM y = x W^T, x = [micro-batch x seq, in], is timed
in the config's dtype (model.dtype bf16: bf16 weights and inputs, the paper's pure bf16) alone (median of --reps after
2 warm-up calls; ranks run concurrently, as in training); a linear's numbers sum its GEMMs (fused qkv / gate_up for
Megatron; down and up factors for the low-rank designs). Linear grouping is not applied here: each factor is its own
GEMM. FLOPs = 2 * tokens * in * out. Utilisation = achieved FLOP/s (median call) over the best FLOP/s of
any single call in the job (square GEMMs of 256..--peak-size and every measured GEMM): on CPU there
is no datasheet peak to divide by, so 100% is this rank's best observed GEMM throughput.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import Int, NumberList, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

LINEARS = ("QKV", "O", "gate/up", "down")
DESIGNS = {"FullRank-TP (megatron)": "megatron", "Vanilla-TP": "vanilla", "BOOST (btp)": "btp"}
DESIGN_NAMES = {s: n for n, s in DESIGNS.items()}


def linear_group(param_name: str) -> str:
    """QKV / O / gate/up / down for a block parameter name (fused or factorised)."""
    seg = next(p for p in param_name.split(".") if p.endswith("_proj"))[: -len("_proj")]
    return {"qkv": "QKV", "q": "QKV", "k": "QKV", "v": "QKV", "o": "O",
            "gate_up": "gate/up", "gate": "gate/up", "up": "gate/up", "down": "down"}[seg]


def gemm_seconds(x: Any, w: Any, reps: int, device: Any) -> tuple:
    """(median, minimum) seconds of F.linear(x, w) over `reps` calls."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    for _ in range(2):
        F.linear(x, w)
    times = []
    with torch.no_grad():
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            F.linear(x, w)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def measure_worker(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    names, cfgs, ctx = bl.worker_configs(args)
    g = torch.Generator().manual_seed(0)
    # the reference (100%): the best FLOP/s of any single call in this job, square GEMMs of
    # 256..--peak-size and every measured GEMM alike (best of reps: capability, not load)
    peak = 0.0
    n = args.peak_size
    with bw.timing_precision(cfgs[0], [], ctx.device, bc.PRECISION) as cast:
        while n >= 256:
            a = cast(torch.randn(n, n, generator=g).to(ctx.device))
            bt.sync_all(ctx.device)
            peak = max(peak, 2 * n ** 3 / gemm_seconds(a, a, args.reps, ctx.device)[1])
            n //= 2
    rows = []
    for name, cfg in zip(names, cfgs):
        model = bw.build_trainee(cfg, ctx, with_optimizer=False).model
        block = bw.first_local_block(model)
        with bw.timing_precision(cfg, [block], ctx.device, bc.PRECISION) as cast:
            weights = [(pn, p.detach()) for pn, p in block.named_parameters() if p.ndim == 2 and "_proj" in pn]
            for mb in [int(b) for b in args.batches.split(",")]:
                tokens = mb * cfg.tokens.sequence_length
                per: Dict[str, Dict[str, float]] = {k: {"flops": 0.0, "seconds": 0.0, "gemms": 0} for k in LINEARS}
                for pn, w in weights:
                    x = cast(torch.randn(tokens, w.shape[1], generator=g).to(ctx.device))
                    bt.sync_all(ctx.device)
                    sec, best = gemm_seconds(x, w, args.reps, ctx.device)
                    flops = 2.0 * tokens * w.shape[0] * w.shape[1]
                    peak = max(peak, flops / best)
                    grp = per[linear_group(pn)]
                    grp["flops"] += flops
                    grp["seconds"] += sec
                    grp["gemms"] += 1
                for lin, v in per.items():
                    rows.append({"design": name, "micro_batch": mb, "linear": lin, **v})
        bw.release(model)
    # mean over ranks (the shards of one design have equal shapes on every rank)
    all_rows = bl.gather_to_main(rows)
    peaks = bl.gather_to_main(peak)
    for i, r in enumerate(rows):
        r["seconds"] = statistics.fmean(rr[i]["seconds"] for rr in all_rows)
    peak_mean = statistics.fmean(peaks)
    for r in rows:
        r["flops_per_s"] = r["flops"] / r["seconds"] if r["seconds"] else None
        r["utilisation"] = r["flops_per_s"] / peak_mean if r["flops_per_s"] else None
    return {"rows": rows, "meta": {**bl.worker_meta(ctx), "peak_flops_per_s": peak_mean,
                                   "peak_size": n}}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bw.add_model_args(p)
    bl.add_run_args(p, iters=1, warmup=0, out="runs/boost/fig7_compute.png")
    p.add_argument("--batches", default="1,2,4,8", type=NumberList(1),
                   help="micro-batch sizes (left/middle panels: --micro-batch)")
    p.add_argument("--reps", type=Int(1), default=9, help="timed calls per GEMM (median)")
    p.add_argument("--peak-size", type=Int(1), default=1024,
                   help="largest square reference GEMM (sizes halve down to 256); 100%% = best FLOP/s of any call")
    br.help_with_defaults(p)
    args = p.parse_args(own)
    if args.out is None:
        args.out = "runs/boost/fig7_compute.png"
    done = bl.early_phase(args, measure_worker, lambda saved: publish(saved["rows"], saved["meta"], args.out),
                          check_iters=False)
    if done is not None:
        return done
    registered = bw.require_strategies(list(DESIGNS.values()))
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {name: bw.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind))
            for name, s in DESIGNS.items() if s in registered}
    mb0 = next(iter(cfgs.values())).tokens.micro_batch_size
    batches = sorted({int(b) for b in args.batches.split(",")} | {mb0})
    result = bl.run_job(__file__, cfgs, ["--batches", ",".join(map(str, batches)), "--reps", str(args.reps),
                                         "--peak-size", str(args.peak_size)], torchrun_args, args.log_dir,
                        args.timeout, args.verbose)
    meta = {**result["meta"], "low_rank_kind": kind, "micro_batch": mb0,
            "precision": bw.precision_label(next(iter(cfgs.values())), bc.PRECISION)}
    return publish(result["rows"], meta, args.out)


def add_ratios(rows: Sequence[Dict[str, Any]]) -> None:
    """Each linear's FLOPs over the full-rank and the vanilla design's, utilisation and GEMM time
    over vanilla's, at the same micro-batch."""
    by = {(DESIGNS.get(r["design"]), r["micro_batch"], r["linear"]): r for r in rows}
    for r in rows:
        ref = {s: by.get((s, r["micro_batch"], r["linear"])) for s in ("megatron", "vanilla")}
        r["flops_vs_megatron"] = bc.ratio(r["flops"], ref["megatron"]["flops"]) if ref["megatron"] else None
        van = ref["vanilla"]
        r["flops_vs_vanilla"] = bc.ratio(r["flops"], van["flops"]) if van else None
        r["util_vs_vanilla"] = bc.ratio(r["utilisation"], van["utilisation"]) if van else None
        r["seconds_vs_vanilla"] = bc.ratio(r["seconds"], van["seconds"]) if van else None


def claims_for(mb0: int) -> List[bp.PaperClaim]:
    """Figure 7, per linear at the shown micro-batch: both low-rank designs do fewer FLOPs than full
    rank and the same as each other (left); BOOST has the higher utilisation and finishes its GEMMs
    sooner than vanilla (middle). The paper gives these as bars, not numbers."""
    btp, src = DESIGN_NAMES["btp"], "Fig. 7"
    out = []
    for lin in LINEARS:
        at = {"design": btp, "micro_batch": mb0, "linear": lin}
        out += [
            bp.PaperClaim(f"{lin}: BOOST FLOPs / full rank's", "flops_vs_megatron", None, "<", 1.0,
                          where=at, exact=True,
                          source=f"{src} (left)", setting="LLaMA-7B/13B, GPU"),
            bp.PaperClaim(f"{lin}: BOOST FLOPs / vanilla's (identical)", "flops_vs_vanilla", 1.0, "==", 1.0, where=at,
                          source=f"{src} (left)", setting="LLaMA-7B/13B, GPU"),
            bp.PaperClaim(f"{lin}: BOOST utilisation / vanilla's", "util_vs_vanilla", None, ">", 1.0, where=at,
                          source=f"{src} (middle)", setting="LLaMA-7B/13B, GPU"),
        ]
    return out


def plot(rows: Sequence[Dict[str, Any]], mb0: int) -> Any:
    """The three panels from the rows."""
    at = {(r["design"], r["micro_batch"], r["linear"]): r for r in rows}
    names = [n for n in DESIGNS if any(r["design"] == n for r in rows)]
    batches = sorted({r["micro_batch"] for r in rows})
    fig, axes = br.new_figure(3, width=16 / 3)
    br.grouped_bars(axes[0], list(LINEARS), {n: [at[(n, mb0, lin)]["flops"] / 1e9 for lin in LINEARS] for n in names},
                    ylabel="forward GEMM work per rank (GFLOP)", color=bc.design_color)
    tw = axes[0].twinx()
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(LINEARS))]
        tw.plot(xs, [at[(n, mb0, lin)]["seconds"] * 1e3 for lin in LINEARS], "kD", ms=4,
                label="GEMM time" if i == 0 else None)
    tw.set_ylabel("GEMM time (ms, diamonds)")
    tw.legend(fontsize=7, loc="upper center")
    axes[0].set_title(f"work and time per linear (bz={mb0})")
    br.grouped_bars(axes[1], list(LINEARS),
                    {n: [100 * at[(n, mb0, lin)]["utilisation"] for lin in LINEARS] for n in names},
                    ylabel="utilisation (% of best GEMM FLOP/s)", color=bc.design_color)
    axes[1].set_title(f"utilisation per linear (bz={mb0})")
    for n in names:
        if DESIGNS[n] == "megatron":
            continue
        for lin, style in zip(LINEARS, ("o-", "s-", "^-", "v-")):
            axes[2].plot(batches, [100 * at[(n, b, lin)]["utilisation"] for b in batches], style,
                         color=bc.design_color(n), label=f"{n} {lin}", ms=4, alpha=0.9)
    axes[2].set_xlabel("micro-batch size")
    axes[2].set_ylabel("utilisation (%)")
    axes[2].set_title("utilisation against micro-batch size")
    for ax in axes:
        ax.legend(fontsize=6)
    return fig


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: str) -> int:
    """Table at the shown micro-batch with ratios beside the paper's, verdicts, PNG + JSON + markdown."""
    batches = sorted({r["micro_batch"] for r in rows})
    # results saved before the micro-batch was recorded were measured at the default micro-batch
    mb0 = meta.get("micro_batch") or (bw.BENCH_DEFAULTS["micro_batch"] if bw.BENCH_DEFAULTS["micro_batch"] in batches
                                      else batches[0])
    add_ratios(rows)
    claims = claims_for(mb0)
    bp.annotate(rows, claims)
    verdicts = bp.evaluate(claims, rows)
    headers = ["design", "bz", "linear", "GEMMs", "GFLOP", "ms", "GFLOP/s", "util %", "FLOPs / full", "paper",
               "FLOPs / vanilla", "paper", "util / vanilla", "paper"]
    body = [[r["design"], r["micro_batch"], r["linear"], r["gemms"], f"{r['flops'] / 1e9:.3f}",
             f"{r['seconds'] * 1e3:.2f}", f"{r['flops_per_s'] / 1e9:.1f}", f"{100 * r['utilisation']:.0f}",
             br.fmt_x(r["flops_vs_megatron"]), br.fmt_x(r.get("paper_flops_vs_megatron")),
             br.fmt_x(r["flops_vs_vanilla"]), br.fmt_x(r.get("paper_flops_vs_vanilla")),
             br.fmt_x(r["util_vs_vanilla"]), br.fmt_x(r.get("paper_util_vs_vanilla"))]
            for r in rows if r["micro_batch"] == mb0]
    print(br.format_table(headers, body))
    print("\n".join(bp.verdict_lines(verdicts)))
    title = (f"BOOST Figure 7 at CPU scale: per-linear forward GEMMs on TP rank shards, TP={meta.get('tp')}, "
             f"100% = {meta['peak_flops_per_s'] / 1e9:.1f} GFLOP/s (best single GEMM call)")
    written = br.write_report(Path(out).with_suffix(".json"), rows, meta, title, headers, body, verdicts=verdicts,
                              figure=plot(rows, mb0),
                              notes=[f"table at micro-batch {mb0}; the paper's Figure 7 gives bars (no numbers): "
                                     "the paper column holds only the identical-FLOPs ratio."])
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
