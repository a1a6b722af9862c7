"""BOOST Table 3: per-decoder-block time, default (ungrouped) vs grouped linears, under BTP.

    python reproduce/boost/table3_grouping.py [options] [-- torchrun options]   (default TP=2 on CPU)

One torchrun job builds the low-rank model under btp twice, model.boost.group_linears off and on
(same weights: parameter names do not depend on grouping), and for each micro-batch size
(--batches, paper: 1 and 4) times forward+backward of the first decoder block's attention
sub-layer (norm, q/k/v, attention, o), its MLP sub-layer (norm, gate/up, SwiGLU, down) and the
whole block, on a [b, s, d/tp] input, iterations of the two models interleaved. Under model.dtype bf16
the blocks and inputs are bf16, as the paper times them (pure bf16: common.PRECISION); fp32 stays fp32.

    total  wall time of iterations WITHOUT the profiler (it slows what it watches, more so the variant
           with more launches: on one H200 the 1B bz=1 block took 11.4 ms profiled, 6.2 ms not)
    comm   time inside collectives, from SEPARATE profiled iterations (each round runs every closure
           once unprofiled, then once under torch.profiler; gloo events on CPU, NCCL kernels on GPU;
           includes waiting for the slower rank, itself slowed by the profiler; mean over ranks)
    comp   mean total - mean comm, a difference of means of separate iterations; its standard error
           and the speedups' are propagated from the means' (nanotron_ext.bench.timing.difference, ratio)
    calls  TP collectives of one forward+backward (ledger)

Results whose meta lacks "totals": "unprofiled" (those committed before this method, the 2026-11-27
H200 runs included) timed the totals under the profiler, comp per iteration from those same iterations.

Paper (CoLA LLaMA-7B, GPU, us): per block 2773 -> 2395 (1.16x) at bz=1, 7577 -> 7266 (1.04x) at bz=4.
The paper's rows are the QKV and MLP1 (gate/up) paths; ours are the sub-layers that contain them.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import NumberList, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

VARIANTS = ("ungrouped", "grouped")
PARTS = ("attention", "mlp", "block")
TITLE = "BOOST Table 3: linear grouping under btp, one decoder block fwd+bwd"
TOTALS = "unprofiled"  # meta["totals"]: the method of this script's results (older ones: profiled)
_GPU = "CoLA LLaMA-7B, TP=4, GPU"
# Table 3 of the paper: grouped speedups per block, and of the QKV / MLP1 (gate-up) paths, which
# sit inside our attention / MLP sub-layers (ours include the norm, attention core, o and down)
CLAIMS = [
    bp.PaperClaim("block time, non-grouped / grouped, bz=1", "speedup", 1.16, ">", 1.0, err_column="speedup_err",
                  where={"micro_batch": 1, "part": "block"}, source="Table 3", setting=_GPU),
    bp.PaperClaim("block time, non-grouped / grouped, bz=4", "speedup", 1.04, ">", 1.0, err_column="speedup_err",
                  where={"micro_batch": 4, "part": "block"}, source="Table 3", setting=_GPU),
] + [
    bp.PaperClaim(f"{part} {what}, non-grouped / grouped, bz={mb}", f"{what}_speedup", value, ">", 1.0,
                  err_column=f"{what}_speedup_err", where={"micro_batch": mb, "part": part}, source="Table 3",
                  setting=f"{_GPU}; paper row {paper_row} {what}")
    for part, paper_row, what, values in (
        ("attention", "QKV", "comp", (1.53, 1.07)), ("attention", "QKV", "comm", (1.41, 1.22)),
        ("mlp", "MLP1", "comp", (1.22, 1.03)), ("mlp", "MLP1", "comm", (1.22, 1.07)))
    for mb, value in zip((1, 4), values)
]


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


def time_variants(fns: Mapping[Any, Callable[[], None]], device: Any, iters: int,
                  ledger: Any) -> Dict[Any, Dict[str, Any]]:
    """Each closure's raw row: unprofiled per-iteration times, seconds in collectives and the wall
    time of the separate profiled iterations, TP calls and bytes."""
    # the two models' iterations alternate; profiled iterations apart from the timed ones
    timings = bt.interleaved(fns, device, iters, ledger=ledger, comm_split=True)
    return {key: {"times": t.wall, "comm_s": t.comm_s, "profiled_times": t.profiled_wall,
                  "tp_calls": t.comm[-1]["calls"], "tp_bytes": t.comm[-1]["bytes"]} for key, t in timings.items()}


def measure_worker(args: argparse.Namespace) -> Dict[str, Any]:
    from nanotron_ext.parallel.comm import get_ledger

    names, cfgs, ctx = bl.worker_configs(args)
    models = {n: bw.build_trainee(c, ctx, with_optimizer=False).model for n, c in zip(names, cfgs)}
    blocks = {n: bw.first_local_block(m) for n, m in models.items()}
    ledger = get_ledger()
    rows = []
    with contextlib.ExitStack() as stack:  # the paper's precision (pure bf16 under model.dtype bf16), set up once
        casts = {n: stack.enter_context(bw.timing_precision(c, [blocks[n]], ctx.device, bc.PRECISION))
                 for n, c in zip(names, cfgs)}
        for mb in [int(b) for b in args.batches.split(",")]:
            fns = {n: part_fns(blocks[n], casts[n](bc.block_input(c, models[n], ctx, mb)), c.model.low_rank.kind)
                   for n, c in zip(names, cfgs)}
            flat = {(n, part): fn for n in names for part, fn in fns[n].items()}
            for (n, part), raw in time_variants(flat, ctx.device, args.iters, ledger).items():
                rows.append({"variant": n, "micro_batch": mb, "part": part, **raw})
    return {"rows": rows, "meta": bl.worker_meta(ctx)}


def compare(rows: Sequence[Dict[str, Any]], warmup: int) -> List[Dict[str, Any]]:
    """Per (micro-batch, part): total/comm/comp for both variants and the grouped speedups (+- s.e.).
    Totals from `times`, comm from `comm_s` (separate profiled iterations), comp their difference of means."""
    by = {(r["variant"], r["micro_batch"], r["part"]): r for r in rows}
    out = []
    for (variant, mb, part), un in sorted(by.items(), key=lambda kv: (kv[0][1], PARTS.index(kv[0][2]))):
        if variant != "ungrouped" or ("grouped", mb, part) not in by:
            continue
        gr = by[("grouped", mb, part)]
        s_un, s_gr = bt.summarize(un["times"], warmup), bt.summarize(gr["times"], warmup)
        sp, err = bt.speedup(s_un, s_gr)
        c_un, c_gr = bt.summarize(un["comm_s"], warmup), bt.summarize(gr["comm_s"], warmup)
        comm_sp = bt.speedup(c_un, c_gr) if c_gr.mean > 0 else (None, None)
        p_un, p_gr = bt.difference(s_un, c_un), bt.difference(s_gr, c_gr)
        # comm (profiled) can exceed the unprofiled total on tiny blocks: no ratio of a non-positive comp
        comp_sp = bt.ratio(p_un, p_gr) if p_un[0] > 0 and p_gr[0] > 0 else (None, None)
        row = {
            "micro_batch": mb, "part": part,
            "total_ungrouped_s": s_un.mean, "total_grouped_s": s_gr.mean,
            "total_ungrouped_std_s": s_un.std, "total_grouped_std_s": s_gr.std,
            "speedup": sp, "speedup_err": err,
            "comm_ungrouped_s": c_un.mean, "comm_grouped_s": c_gr.mean,
            "comm_speedup": comm_sp[0], "comm_speedup_err": comm_sp[1],
            "comp_ungrouped_s": p_un[0], "comp_grouped_s": p_gr[0],
            "comp_ungrouped_err_s": p_un[1], "comp_grouped_err_s": p_gr[1],
            "comp_speedup": comp_sp[0], "comp_speedup_err": comp_sp[1],
            "tp_calls_ungrouped": un["tp_calls"], "tp_calls_grouped": gr["tp_calls"],
        }
        if un.get("profiled_times") and gr.get("profiled_times"):  # what the profiler costs, for the record
            row["profiled_total_ungrouped_s"] = bt.summarize(un["profiled_times"], warmup).mean
            row["profiled_total_grouped_s"] = bt.summarize(gr["profiled_times"], warmup).mean
        out.append(row)
    return out


def table(rows: Sequence[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    """(headers, body) with the paper's speedup beside each measured one (run `annotate` first)."""
    headers = ["bz", "part", "total non-grouped us", "total grouped us", "speedup", "paper", "comm non us",
               "comm grp us", "comm x", "paper", "comp non us", "comp grp us", "comp x", "paper", "TP calls non/grp"]
    us = 1e6

    def x(v: Optional[float], err: Optional[float] = None) -> str:
        return "-" if v is None else br.fmt_ratio((v, err)) if err is not None else f"{v:.2f}x"

    body = [[r["micro_batch"], r["part"],
             f"{r['total_ungrouped_s'] * us:,.0f} +- {r['total_ungrouped_std_s'] * us:,.0f}",
             f"{r['total_grouped_s'] * us:,.0f} +- {r['total_grouped_std_s'] * us:,.0f}",
             br.fmt_ratio((r["speedup"], r["speedup_err"])), x(r.get("paper_speedup")),
             f"{r['comm_ungrouped_s'] * us:,.0f}", f"{r['comm_grouped_s'] * us:,.0f}",
             x(r["comm_speedup"], r.get("comm_speedup_err")),
             x(r.get("paper_comm_speedup")),
             f"{r['comp_ungrouped_s'] * us:,.0f}", f"{r['comp_grouped_s'] * us:,.0f}",
             x(r["comp_speedup"], r.get("comp_speedup_err")),
             x(r.get("paper_comp_speedup")),
             f"{r['tp_calls_ungrouped']}/{r['tp_calls_grouped']}"] for r in rows]
    return headers, body


def render(rows: Sequence[Dict[str, Any]]) -> str:
    return br.format_table(*table(rows))


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bw.add_model_args(p)
    bl.add_run_args(p, iters=20, warmup=3, out="runs/boost/table3.json")
    p.add_argument("--batches", type=NumberList(1), default="1,4",
                   help="micro-batch sizes (default 1,4 as in the paper)")
    p.add_argument("--rmsnorm", choices=["online", "sync"], default=None, help="btp RMSNorm mode (default: config's)")
    br.help_with_defaults(p)
    args = p.parse_args(own)
    done = bl.early_phase(args, measure_worker, lambda saved: publish(saved["rows"], saved["meta"], args.out))
    if done is not None:
        return done
    if not bw.require_strategies(["btp"]):
        print("btp: not available (tp_strategy not registered): nothing to measure")
        return 0
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {v: bw.resolve_config(args.config_file, shared + bc.strategy_overrides("btp", kind, args.rmsnorm) +
                                 [f"model.boost.group_linears={'true' if v == 'grouped' else 'false'}"])
            for v in VARIANTS}
    result = bl.run_job(__file__, cfgs, ["--batches", args.batches, "--iters", str(args.iters), "--warmup",
                                         str(args.warmup)],
                        torchrun_args, args.log_dir, args.timeout, args.verbose)
    rows = compare(result["rows"], args.warmup)
    c = cfgs["grouped"]
    meta = {**result["meta"], "raw": result["rows"], "low_rank_kind": kind, "totals": TOTALS,
            "precision": bw.precision_label(c, bc.PRECISION), "model_line": (
        f"d={c.model.hidden_size} d_ff={c.model.ffn_size} "
        f"r={c.model.low_rank.width(c.model.hidden_size)} low-rank={kind} rmsnorm={c.model.boost.rmsnorm}; seq "
        f"{c.tokens.sequence_length}; {bw.precision_label(c, bc.PRECISION)}; one decoder block fwd+bwd, "
        f"{args.iters} iterations, first {args.warmup} dropped")}
    return publish(rows, meta, args.out)


def method_note(meta: Dict[str, Any]) -> str:
    """How a result's totals were timed (results before the split timed them under the profiler)."""
    if meta.get("totals") != TOTALS:
        return ("Measured with the old method: totals timed under torch.profiler (slower than without it), "
                "comm and comp = total - comm from those same iterations.")
    return ("Totals from unprofiled iterations; comm from separate profiled iterations; comp = mean total - "
            "mean comm (s.e. propagated).")


def profiler_cost(rows: Sequence[Dict[str, Any]]) -> str:
    """Profiled over unprofiled block time per micro-batch (what the old method added), if recorded."""
    return "".join(f" bz={r['micro_batch']} block profiled / unprofiled: "
                   f"{r['profiled_total_ungrouped_s'] / r['total_ungrouped_s']:.2f}x non-grouped, "
                   f"{r['profiled_total_grouped_s'] / r['total_grouped_s']:.2f}x grouped."
                   for r in rows if r["part"] == "block" and "profiled_total_ungrouped_s" in r)


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: Optional[str]) -> int:
    """Print the table with the paper column and the verdicts; write JSON + markdown with --out."""
    bp.annotate(rows, CLAIMS)
    verdicts = bp.evaluate(CLAIMS, rows)
    print(f"{TITLE} on {meta['machine']}, tp={meta['tp']}, {meta['date']}")
    print(f"model: {meta.get('model_line', 'low-rank=' + str(meta.get('low_rank_kind')))}; "
          f"1-min load avg {meta.get('loadavg_1m')}")
    print(render(rows))
    print("speedup = non-grouped / grouped mean (+- standard error). " + method_note(meta) + profiler_cost(rows))
    print("Paper: " + _GPU + ".")
    print("\n".join(bp.verdict_lines(verdicts)))
    if out:
        title = f"{TITLE}, {meta['precision']}" if meta.get("precision") else TITLE
        notes = ([f"model: {meta['model_line']}."] if meta.get("model_line") else []) + [
            method_note(meta) + profiler_cost(rows),
            "Paper rows QKV and MLP1 are paths inside our attention and MLP sub-layers."]
        written = br.write_report(out, rows, meta, title, *table(rows), verdicts=verdicts, notes=notes)
        print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
