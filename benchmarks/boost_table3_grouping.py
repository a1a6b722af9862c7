"""BOOST Table 3: per-decoder-block time, default (ungrouped) vs grouped linears, under BTP.

    python benchmarks/boost_table3_grouping.py [options] [-- torchrun options]   (default TP=2 on CPU)

One torchrun job builds the low-rank model under btp twice, model.boost.group_linears off and on
(same weights: parameter names do not depend on grouping), and for each micro-batch size
(--batches, paper: 1 and 4) times forward+backward of the first decoder block's attention
sub-layer (norm, q/k/v, attention, o), its MLP sub-layer (norm, gate/up, SwiGLU, down) and the
whole block, on a [b, s, d/tp] input, iterations of the two models interleaved.

    comm   time inside collectives in the same iterations (each runs under torch.profiler, started
           outside the timed window; gloo events on CPU, NCCL kernels on GPU; includes waiting
           for the slower rank; mean over ranks)
    comp   total - comm, per iteration
    calls  TP collectives of one forward+backward (ledger)

Paper (CoLA LLaMA-7B, GPU, us): per block 2773 -> 2395 (1.16x) at bz=1, 7577 -> 7266 (1.04x) at bz=4.
The paper's rows are the QKV and MLP1 (gate/up) paths; ours are the sub-layers that contain them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

VARIANTS = ("ungrouped", "grouped")
PARTS = ("attention", "mlp", "block")


def part_fns(block: Any, x: Any, kind: str) -> Dict[str, Callable[[], None]]:
    """Forward+backward closures of the block's parts (LaX sub-layers are coupled through the
    latent relay, so only the whole block runs alone there)."""
    import torch

    def run(f: Callable[[], Any]) -> Callable[[], None]:
        def go() -> None:
            y = f()
            y.backward(torch.ones_like(y))
            x.grad = None
            block.zero_grad(set_to_none=True)
        return go

    fns = {"block": run(lambda: block(hidden_states=x)["hidden_states"])}
    if kind != "lax":
        fns["attention"] = run(lambda: block.attn(x))
        fns["mlp"] = run(lambda: block.mlp(x))
    return fns


def measure_worker(args: argparse.Namespace) -> Dict[str, Any]:
    from nanotron_ext.parallel.comm import get_ledger

    names, cfgs, ctx = bc.worker_configs(args)
    models = {n: bc.build_trainee(c, ctx, with_optimizer=False).model for n, c in zip(names, cfgs)}
    ledger = get_ledger()
    rows = []
    for mb in [int(b) for b in args.batches.split(",")]:
        fns = {}
        for n, cfg in zip(names, cfgs):
            block = bc.first_local_block(models[n])
            x = bc.block_input(cfg, models[n], ctx, mb)
            fns[n] = part_fns(block, x, cfg.model.low_rank.kind)
        timings: Dict[tuple, bc.Timings] = {}
        for _ in range(args.iters):
            for n in names:  # interleaved
                for part, fn in fns[n].items():
                    t = bc.timed(fn, ctx.device, 1, ledger=ledger, profile=True)
                    timings.setdefault((n, part), bc.Timings([], [], [])).extend(t)
        for (n, part), t in timings.items():
            rows.append({"variant": n, "micro_batch": mb, "part": part, "times": t.wall, "comm_s": t.comm_s,
                         "tp_calls": t.comm[-1]["calls"], "tp_bytes": t.comm[-1]["bytes"]})
    return {"rows": rows, "meta": bc.common_worker_meta(cfgs[0], ctx)}


def compare(rows: Sequence[Dict[str, Any]], warmup: int) -> List[Dict[str, Any]]:
    """Per (micro-batch, part): total/comm/comp for both variants and the grouped speedups."""
    by = {(r["variant"], r["micro_batch"], r["part"]): r for r in rows}
    out = []
    for (variant, mb, part), un in sorted(by.items(), key=lambda kv: (kv[0][1], PARTS.index(kv[0][2]))):
        if variant != "ungrouped" or ("grouped", mb, part) not in by:
            continue
        gr = by[("grouped", mb, part)]
        s_un, s_gr = bc.summarize(un["times"], warmup), bc.summarize(gr["times"], warmup)
        sp, err = bc.speedup(s_un, s_gr)
        c_un, c_gr = bc.summarize(un["comm_s"], warmup), bc.summarize(gr["comm_s"], warmup)
        # compute = wall - comm of the SAME iteration, then summarised
        p_un = bc.summarize([w - c for w, c in zip(un["times"], un["comm_s"])], warmup)
        p_gr = bc.summarize([w - c for w, c in zip(gr["times"], gr["comm_s"])], warmup)
        comp_un, comp_gr = p_un.mean, p_gr.mean
        out.append({
            "micro_batch": mb, "part": part,
            "total_ungrouped_s": s_un.mean, "total_grouped_s": s_gr.mean,
            "total_ungrouped_std_s": s_un.std, "total_grouped_std_s": s_gr.std,
            "speedup": sp, "speedup_err": err,
            "comm_ungrouped_s": c_un.mean, "comm_grouped_s": c_gr.mean,
            "comm_speedup": c_un.mean / c_gr.mean if c_gr.mean > 0 else None,
            "comp_ungrouped_s": comp_un, "comp_grouped_s": comp_gr,
            "comp_speedup": comp_un / comp_gr if comp_gr > 0 else None,
            "tp_calls_ungrouped": un["tp_calls"], "tp_calls_grouped": gr["tp_calls"],
        })
    return out


def render(rows: Sequence[Dict[str, Any]]) -> str:
    headers = ["bz", "part", "total non-grouped us", "total grouped us", "speedup", "comm non us", "comm grp us",
               "comm x", "comp non us", "comp grp us", "comp x", "TP calls non/grp"]
    us = 1e6

    def x(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}x"

    body = [[r["micro_batch"], r["part"],
             f"{r['total_ungrouped_s'] * us:,.0f} +- {r['total_ungrouped_std_s'] * us:,.0f}",
             f"{r['total_grouped_s'] * us:,.0f} +- {r['total_grouped_std_s'] * us:,.0f}",
             bc.fmt_ratio((r["speedup"], r["speedup_err"])),
             f"{r['comm_ungrouped_s'] * us:,.0f}", f"{r['comm_grouped_s'] * us:,.0f}", x(r["comm_speedup"]),
             f"{r['comp_ungrouped_s'] * us:,.0f}", f"{r['comp_grouped_s'] * us:,.0f}", x(r["comp_speedup"]),
             f"{r['tp_calls_ungrouped']}/{r['tp_calls_grouped']}"] for r in rows]
    return bc.format_table(headers, body)


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bc.split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    bc.add_run_args(p, iters=20, warmup=3)
    p.add_argument("--batches", default="1,4", help="micro-batch sizes (default 1,4 as in the paper)")
    p.add_argument("--rmsnorm", choices=["online", "sync"], default=None, help="btp RMSNorm mode (default: config's)")
    args = p.parse_args(own)
    if args.worker:
        bc.write_worker_result(args.result_file, measure_worker(args))
        return 0
    if args.iters <= args.warmup:
        raise SystemExit(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    if not bc.require_strategies(["btp"]):
        print("btp: not available (tp_strategy not registered): nothing to measure")
        return 0
    shared = bc.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {v: bc.resolve_config(args.config_file, shared + bc.strategy_overrides("btp", kind, args.rmsnorm) +
                                 [f"model.boost.group_linears={'true' if v == 'grouped' else 'false'}"])
            for v in VARIANTS}
    result = bc.run_job(__file__, cfgs, ["--batches", args.batches, "--iters", str(args.iters), "--warmup",
                                         str(args.warmup)],
                        torchrun_args, args.log_dir, args.timeout, args.verbose)
    rows = compare(result["rows"], args.warmup)
    meta, c = result["meta"], cfgs["grouped"]
    print(f"BOOST Table 3 (linear grouping under btp) on {meta['machine']}, tp={meta['tp']}, {meta['date']}")
    print(f"model: d={c.model.hidden_size} d_ff={c.model.ffn_size} r={c.model.rank} low-rank={kind} "
          f"rmsnorm={c.model.boost.rmsnorm}; seq {c.tokens.sequence_length}; one decoder block fwd+bwd, "
          f"{args.iters} iterations, first {args.warmup} dropped; 1-min load avg {meta.get('loadavg_1m')}")
    print(render(rows))
    print("speedup = non-grouped / grouped mean (+- standard error); comp = total - comm.")
    if args.out:
        print(f"wrote {bc.write_rows(args.out, rows, {**meta, 'raw': result['rows'], 'low_rank_kind': kind})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
