"""BOOST Figure 7 at the scale of this machine: computation efficiency of each linear layer.

    (left)   forward GEMM work (FLOPs) and GEMM time per linear (QKV, O, gate/up, down) for
             full-rank Megatron TP, vanilla low-rank TP and btp
    (middle) hardware utilisation of each linear, vanilla vs btp (and full rank)
    (right)  utilisation against the micro-batch size

    python benchmarks/boost_fig7_compute.py [--batches 1,2,4,8] [--out runs/boost/fig7_cpu.png] [-- torchrun args]

One torchrun job (default 2 CPU ranks, TP=2) builds each model and takes the GEMM shapes from this
rank's actual weight shards of the first decoder block (so each design's split is exactly what
the strategy builds). Every weight's forward GEMM y = x W^T, x = [micro-batch x seq, in], is timed
alone (median of --reps after 2 warm-up calls; ranks run concurrently, as in training); a
linear's numbers sum its GEMMs (fused qkv / gate_up for Megatron; down and up factors for the
low-rank designs). Linear grouping is not applied here: each factor is its own GEMM.
FLOPs = 2 * tokens * in * out. Utilisation = achieved FLOP/s (median call) over the best FLOP/s of
any single call in the job (square GEMMs of 256..--peak-size and every measured GEMM): on CPU there
is no datasheet peak to divide by, so 100% is this rank's best observed GEMM throughput.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

LINEARS = ("QKV", "O", "gate/up", "down")
DESIGNS = {"FullRank-TP (megatron)": "megatron", "Vanilla-TP": "vanilla", "BOOST (btp)": "btp"}


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

    names, cfgs, ctx = bc.worker_configs(args)
    dtype = torch.bfloat16 if cfgs[0].model.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    # the reference (100%): the best FLOP/s of any single call in this job, square GEMMs of
    # 256..--peak-size and every measured GEMM alike (best of reps: capability, not load)
    peak = 0.0
    n = args.peak_size
    while n >= 256:
        a = torch.randn(n, n, generator=g).to(ctx.device, dtype)
        bc.sync_all(ctx.device)
        peak = max(peak, 2 * n ** 3 / gemm_seconds(a, a, args.reps, ctx.device)[1])
        n //= 2
    rows = []
    for name, cfg in zip(names, cfgs):
        model = bc.build_trainee(cfg, ctx, with_optimizer=False).model
        block = bc.first_local_block(model)
        weights = [(pn, p.detach().to(dtype)) for pn, p in block.named_parameters() if p.ndim == 2 and "_proj" in pn]
        for mb in [int(b) for b in args.batches.split(",")]:
            tokens = mb * cfg.tokens.sequence_length
            per: Dict[str, Dict[str, float]] = {k: {"flops": 0.0, "seconds": 0.0, "gemms": 0} for k in LINEARS}
            for pn, w in weights:
                x = torch.randn(tokens, w.shape[1], generator=g).to(ctx.device, dtype)
                bc.sync_all(ctx.device)
                sec, best = gemm_seconds(x, w, args.reps, ctx.device)
                flops = 2.0 * tokens * w.shape[0] * w.shape[1]
                peak = max(peak, flops / best)
                grp = per[linear_group(pn)]
                grp["flops"] += flops
                grp["seconds"] += sec
                grp["gemms"] += 1
            for lin, v in per.items():
                rows.append({"design": name, "micro_batch": mb, "linear": lin, **v})
        bc.release(model)
    # mean over ranks (the shards of one design have equal shapes on every rank)
    all_rows = bc.gather_to_main(rows)
    peaks = bc.gather_to_main(peak)
    for i, r in enumerate(rows):
        r["seconds"] = statistics.fmean(rr[i]["seconds"] for rr in all_rows)
    peak_mean = statistics.fmean(peaks)
    for r in rows:
        r["flops_per_s"] = r["flops"] / r["seconds"] if r["seconds"] else None
        r["utilisation"] = r["flops_per_s"] / peak_mean if r["flops_per_s"] else None
    return {"rows": rows, "meta": {**bc.common_worker_meta(cfgs[0], ctx), "peak_flops_per_s": peak_mean,
                                   "peak_size": n}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bc.split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    bc.add_run_args(p, iters=1, warmup=0)
    p.add_argument("--batches", default="1,2,4,8", help="micro-batch sizes (left/middle panels: --micro-batch)")
    p.add_argument("--reps", type=int, default=9, help="timed calls per GEMM (median)")
    p.add_argument("--peak-size", type=int, default=1024,
                   help="largest square reference GEMM (sizes halve down to 256); 100%% = best FLOP/s of any call")
    args = p.parse_args(own)
    if args.worker:
        bc.write_worker_result(args.result_file, measure_worker(args))
        return 0
    if args.out is None:
        args.out = "runs/boost/fig7_compute.png"
    registered = bc.require_strategies(list(DESIGNS.values()))
    shared = bc.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {name: bc.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind))
            for name, s in DESIGNS.items() if s in registered}
    mb0 = next(iter(cfgs.values())).tokens.micro_batch_size
    batches = sorted({int(b) for b in args.batches.split(",")} | {mb0})
    result = bc.run_job(__file__, cfgs, ["--batches", ",".join(map(str, batches)), "--reps", str(args.reps),
                                         "--peak-size", str(args.peak_size)], torchrun_args, args.log_dir,
                        args.timeout, args.verbose)
    rows, meta = result["rows"], result["meta"]
    at = {(r["design"], r["micro_batch"], r["linear"]): r for r in rows}
    names = list(cfgs)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    bc.grouped_bars(axes[0], list(LINEARS), {n: [at[(n, mb0, lin)]["flops"] / 1e9 for lin in LINEARS] for n in names},
                    ylabel="forward GEMM work per rank (GFLOP)")
    tw = axes[0].twinx()
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(LINEARS))]
        tw.plot(xs, [at[(n, mb0, lin)]["seconds"] * 1e3 for lin in LINEARS], "kD", ms=4,
                label="GEMM time" if i == 0 else None)
    tw.set_ylabel("GEMM time (ms, diamonds)")
    tw.legend(fontsize=7, loc="upper center")
    axes[0].set_title(f"work and time per linear (bz={mb0})")
    bc.grouped_bars(axes[1], list(LINEARS), {n: [100 * at[(n, mb0, lin)]["utilisation"] for lin in LINEARS] for n in names},
                    ylabel="utilisation (% of best GEMM FLOP/s)")
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
    fig.suptitle(bc.figure_title(f"BOOST Figure 7 at CPU scale: per-linear forward GEMMs on TP rank shards, "
                                 f"TP={meta.get('tp')}, 100% = {meta['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
                                 f"(best single GEMM call)", meta), fontsize=10)
    png, js = bc.save_figure(fig, args.out, rows, {**meta, "low_rank_kind": kind})
    headers = ["design", "bz", "linear", "GEMMs", "GFLOP", "ms", "GFLOP/s", "util %"]
    print(bc.format_table(headers, [[r["design"], r["micro_batch"], r["linear"], r["gemms"], f"{r['flops'] / 1e9:.3f}",
                                     f"{r['seconds'] * 1e3:.2f}", f"{r['flops_per_s'] / 1e9:.1f}",
                                     f"{100 * r['utilisation']:.0f}"] for r in rows if r["micro_batch"] == mb0]))
    print(f"wrote {png} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
