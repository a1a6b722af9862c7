"""BOOST Table 5: low-rank activation checkpointing, memory saved vs extra time (vanilla vs BTP).

    python reproduce/boost/table5_checkpointing.py [options] [-- torchrun options]   (default TP=2 on CPU)

One torchrun job builds the low-rank model four times: {vanilla, btp} x model.boost.lowrank_checkpointing
{off, on}. For each micro-batch size (--batches, paper: 4 and 8) it measures, per TP rank, in the
config's dtype (model.dtype bf16: bf16 weights and inputs, as the paper; common.PRECISION):

    act off / on   bytes the allocator holds after one micro-batch forward (torch.profiler
                   profile_memory) - the activations kept for backward; "saved" (saved-tensor hooks
                   plus checkpoint inputs) is written to the JSON beside it
    dMem           act(off) - act(on)
    time off / on  forward+backward of the whole model for one micro-batch (perf_counter between
                   barriers, the four models' iterations interleaved, warm-up dropped)
    +Time          time(on) - time(off), with its standard error
    +CPU           the same in process CPU time (max over ranks): the recompute's cost, which the
                   load other tenants put on a shared machine barely changes
    Eff            dMem / +Time (MiB per ms; higher is better), as the paper's Eff_ckpt
    +TP calls      TP collectives of one forward+backward with checkpointing minus without: the
                   collectives a re-forward adds (0 means the recompute is collective-free)

Paper (LLaMA-7B, TP=4, GPU): vanilla 113.7 MB/ms and BOOST 193.5 MB/ms at bz=4.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import NumberList, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

STRATEGIES = ("vanilla", "btp")
TITLE = "BOOST Table 5: low-rank activation checkpointing"
_GPU = "LLaMA-7B, TP=4, GPU"
# Table 5: dMem (MB), +Time (ms), Eff_ckpt (MB/ms) per (strategy, bz); ours are MiB on a tiny model
PAPER_T5 = {("vanilla", 4): (26_022, 229, 113.7), ("btp", 4): (17_414, 90, 193.5),
            ("vanilla", 8): (52_280, 460, 113.6), ("btp", 8): (35_392, 200, 177.0)}
CLAIMS: List[bp.PaperClaim] = []
for _mb in (4, 8):
    _van, _btp = PAPER_T5[("vanilla", _mb)], PAPER_T5[("btp", _mb)]
    CLAIMS += [
        bp.PaperClaim(f"BOOST Eff / vanilla's, bz={_mb}", "eff_vs_vanilla", _btp[2] / _van[2], ">", 1.0,
                      where={"strategy": "btp", "micro_batch": _mb}, source="Table 5", setting=_GPU),
        bp.PaperClaim(f"BOOST +Time / vanilla's, bz={_mb}", "d_time_vs_vanilla", _btp[1] / _van[1], "<", 1.0,
                      where={"strategy": "btp", "micro_batch": _mb}, source="Table 5", setting=_GPU),
        bp.PaperClaim(f"BOOST dMem / vanilla's, bz={_mb}", "d_mem_vs_vanilla", _btp[0] / _van[0], "<", 1.0,
                      where={"strategy": "btp", "micro_batch": _mb}, source="Table 5", setting=_GPU),
    ]


def variant_name(strategy: str, ckpt: bool) -> str:
    return f"{strategy}/ckpt-{'on' if ckpt else 'off'}"


def measure_worker(args: argparse.Namespace) -> Dict[str, Any]:
    names, cfgs, ctx = bl.worker_configs(args)
    if ctx.pp_pg.size() != 1:
        raise ValueError("table5_checkpointing measures one stage holding the whole model: use pp = 1")
    trainees = {n: bw.build_trainee(c, ctx, with_optimizer=False) for n, c in zip(names, cfgs)}
    rows = []
    with contextlib.ExitStack() as stack:  # the paper's precision (pure bf16 under model.dtype bf16), set up once
        for t in trainees.values():
            stack.enter_context(bw.timing_precision(t.cfg, [t.model], ctx.device, bc.PRECISION))
        for mb in [int(b) for b in args.batches.split(",")]:
            rows += measure_batch(trainees, ctx, mb, args.iters, args.warmup)
    return {"rows": rows, "meta": bl.worker_meta(ctx)}


def measure_batch(trainees: Dict[str, bw.Trainee], ctx: Any, mb: int, iters: int, warmup: int) -> List[Dict[str, Any]]:
    """One raw row per model at micro-batch `mb`: forward+backward times (interleaved), TP calls, activations."""
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.train.pipeline_step import forward_backward

    ledger = get_ledger()
    batches = {n: bw.random_micro_batches(t.cfg, 1, micro_batch=mb) for n, t in trainees.items()}

    def step(n: str) -> None:
        t = trainees[n]
        forward_backward(t.model, t.engine, batches[n], ctx)
        t.model.zero_grad(set_to_none=True)

    per: Dict[str, Dict[str, Any]] = {n: {"wall": [], "cpu": [], "calls": []} for n in trainees}
    for _ in range(iters):
        for n in trainees:  # interleaved: a load change on a shared machine hits all four alike
            timing = bt.timed(lambda n=n: step(n), ctx.device, 1, ledger=ledger)
            per[n]["wall"] += timing.wall
            per[n]["cpu"] += timing.cpu
            per[n]["calls"] += [c["calls"] for c in timing.comm]
    rows = []
    for n, t in trainees.items():
        mbatch = batches[n][0]
        ids, labels = mbatch["input_ids"].to(ctx.device), mbatch["label_ids"].to(ctx.device)
        loss, act = bc.activation_bytes(t.model, lambda t=t, ids=ids, labels=labels: t.model(
                                            input_ids=ids, label_ids=labels)["loss"],
                                        ctx.device)
        loss.backward()
        t.model.zero_grad(set_to_none=True)
        act_all = bl.gather_to_main(act)
        rows.append({
            "variant": n, "micro_batch": mb, "times": per[n]["wall"], "cpu_times": per[n]["cpu"],
            "tp_calls": statistics.fmean(per[n]["calls"][warmup:]),
            "act_alloc": act_all[0]["allocator"], "act_saved": act_all[0]["saved"],
            "act_alloc_max_over_ranks": max(a["allocator"] for a in act_all),
        })
    return rows


def compare(rows: Sequence[Dict[str, Any]], warmup: int) -> List[Dict[str, Any]]:
    """Per (strategy, micro-batch): dMem, +Time (with s.e.), Eff and extra TP calls from the raw rows."""
    by = {(r["variant"], r["micro_batch"]): r for r in rows}
    out = []
    for (variant, mb), off in by.items():
        strategy, mode = variant.split("/")
        if mode != "ckpt-off" or (variant_name(strategy, True), mb) not in by:
            continue
        on = by[(variant_name(strategy, True), mb)]
        s_off, s_on = bt.summarize(off["times"], warmup), bt.summarize(on["times"], warmup)
        d_mem = off["act_alloc"] - on["act_alloc"]
        d_time = s_on.mean - s_off.mean
        d_time_err = math.sqrt(s_on.sem ** 2 + s_off.sem ** 2)
        c_off, c_on = bt.summarize(off["cpu_times"], warmup), bt.summarize(on["cpu_times"], warmup)
        d_cpu, d_cpu_err = c_on.mean - c_off.mean, math.sqrt(c_on.sem ** 2 + c_off.sem ** 2)
        eff = (d_mem / 2**20) / (d_time * 1e3) if d_time > 0 else None
        eff_cpu = (d_mem / 2**20) / (d_cpu * 1e3) if d_cpu > 0 else None
        out.append({
            "strategy": strategy, "micro_batch": mb,
            "act_off_bytes": off["act_alloc"], "act_on_bytes": on["act_alloc"], "d_mem_bytes": d_mem,
            "act_saved_off_bytes": off["act_saved"], "act_saved_on_bytes": on["act_saved"],
            "time_off_s": s_off.mean, "time_on_s": s_on.mean, "d_time_s": d_time, "d_time_err_s": d_time_err,
            "eff_mib_per_ms": eff, "cpu_off_s": c_off.mean, "cpu_on_s": c_on.mean, "d_cpu_s": d_cpu,
            "d_cpu_err_s": d_cpu_err, "eff_cpu_mib_per_ms": eff_cpu, "extra_tp_calls": on["tp_calls"] - off["tp_calls"],
            "tp_calls_off": off["tp_calls"], "tp_calls_on": on["tp_calls"],
        })
    return sorted(out, key=lambda r: (r["micro_batch"], STRATEGIES.index(r["strategy"])
                                      if r["strategy"] in STRATEGIES else 9))


def add_ratios(rows: Sequence[Dict[str, Any]]) -> None:
    """BOOST's dMem, +Time and Eff over vanilla's at the same micro-batch (what Table 5 compares)."""
    van = {r["micro_batch"]: r for r in rows if r["strategy"] == "vanilla"}
    for r in rows:
        v = van.get(r["micro_batch"])
        for col, key in (("d_mem_vs_vanilla", "d_mem_bytes"), ("d_time_vs_vanilla", "d_time_s"),
                         ("eff_vs_vanilla", "eff_mib_per_ms")):
            r[col] = bc.ratio(r[key], v[key]) if v is not None else None


def render(rows: Sequence[Dict[str, Any]]) -> str:
    return br.format_table(*table(rows))


def table(rows: Sequence[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    """(headers, body) with the paper's dMem (MB), +Time (ms), Eff (MB/ms) beside ours and the
    BOOST / vanilla ratios beside the paper's."""
    headers = ["strategy", "bz", "act off MiB", "act on MiB", "dMem MiB", "paper MB", "time off ms", "time on ms",
               "+Time ms", "paper ms", "Eff MiB/ms", "paper MB/ms", "+CPU ms", "Eff(CPU) MiB/ms", "TP calls off",
               "+TP calls", "Eff / vanilla", "paper"]
    body = []
    for r in rows:
        eff = "-" if r["eff_mib_per_ms"] is None else f"{r['eff_mib_per_ms']:.1f}"
        eff_cpu = "-" if r["eff_cpu_mib_per_ms"] is None else f"{r['eff_cpu_mib_per_ms']:.1f}"
        pm, pt, pe = PAPER_T5.get((r["strategy"], r["micro_batch"]), (None, None, None))
        body.append([r["strategy"], r["micro_batch"], br.fmt_bytes(r["act_off_bytes"], "MiB"),
                     br.fmt_bytes(r["act_on_bytes"], "MiB"), br.fmt_bytes(r["d_mem_bytes"], "MiB"),
                     None if pm is None else f"{pm:,}", f"{r['time_off_s'] * 1e3:,.1f}", f"{r['time_on_s'] * 1e3:,.1f}",
                     f"{r['d_time_s'] * 1e3:,.1f} +- {r['d_time_err_s'] * 1e3:,.1f}", pt, eff, pe,
                     f"{r['d_cpu_s'] * 1e3:,.1f} +- {r['d_cpu_err_s'] * 1e3:,.1f}", eff_cpu,
                     f"{r['tp_calls_off']:g}", f"{r['extra_tp_calls']:+g}", br.fmt_x(r.get("eff_vs_vanilla")),
                     br.fmt_x(r.get("paper_eff_vs_vanilla"))])
    return headers, body


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bw.add_model_args(p)
    bl.add_run_args(p, iters=10, warmup=2, out="runs/boost/table5.json")
    p.add_argument("--batches", type=NumberList(1), default="4,8",
                   help="micro-batch sizes (default 4,8 as in the paper)")
    br.help_with_defaults(p)
    args = p.parse_args(own)
    done = bl.early_phase(args, measure_worker, lambda saved: publish(saved["rows"], saved["meta"], args.out))
    if done is not None:
        return done
    strategies = bw.require_strategies(STRATEGIES)
    if not strategies:
        print("no low-rank TP strategy registered: nothing to measure")
        return 0
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {variant_name(s, ck): bw.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind) +
                                                    [f"model.boost.lowrank_checkpointing={str(ck).lower()}"])
            for s in strategies for ck in (False, True)}
    result = bl.run_job(__file__, cfgs, ["--batches", args.batches, "--iters", str(args.iters),
                                         "--warmup", str(args.warmup)], torchrun_args, args.log_dir, args.timeout,
                        args.verbose)
    rows = compare(result["rows"], args.warmup)
    c = next(iter(cfgs.values()))
    meta = {**result["meta"], "raw": result["rows"], "low_rank_kind": kind,
            "precision": bw.precision_label(c, bc.PRECISION), "model_line": (
        f"d={c.model.hidden_size} d_ff={c.model.ffn_size} layers={c.model.num_layers} "
        f"r={c.model.low_rank.width(c.model.hidden_size)} low-rank={kind}; seq {c.tokens.sequence_length}; "
        f"{bw.precision_label(c, bc.PRECISION)}; {args.iters} fwd+bwd per variant, first {args.warmup} "
        "dropped; TP rank 0 memory")}
    for s in STRATEGIES:
        if s not in strategies:
            print(f"{s}: not available (tp_strategy not registered)")
    return publish(rows, meta, args.out)


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: Optional[str]) -> int:
    """Print the table with the paper column and the verdicts; write JSON + markdown with --out."""
    add_ratios(rows)
    bp.annotate(rows, CLAIMS)
    verdicts = bp.evaluate(CLAIMS, rows)
    print(f"{TITLE} on {meta['machine']}, tp={meta['tp']}, {meta['date']}")
    print(f"model: {meta.get('model_line', 'low-rank=' + str(meta.get('low_rank_kind')))}; "
          f"1-min load avg {meta.get('loadavg_1m')}")
    print(render(rows))
    note = ("Eff is '-' when checkpointing did not measurably add time (+Time <= 0); +-: standard error; "
            f"paper: {_GPU}, MB and ms of a 7B model (compare the BOOST / vanilla ratios).")
    print(note)
    print("\n".join(bp.verdict_lines(verdicts)))
    if out:
        written = br.write_report(out, rows, meta, TITLE, *table(rows), verdicts=verdicts, notes=[note])
        print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
