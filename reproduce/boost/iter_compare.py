"""Iteration time of full-rank Megatron TP, vanilla low-rank TP and BOOST (BTP) on one model shape.

    python reproduce/boost/iter_compare.py [options] [-- torchrun options]
    ./run_iter_compare.sh [torchrun options] -- [options]          (the same, torchrun options first)

Each compared row is one torchrun job (default `--nproc_per_node 2`: TP=2 on CPU/gloo) that builds
the model for that strategy and times `--iters` full training iterations (forward/backward over
the micro-batches, grad clipping, AdamW step), dropping the first `--warmup`. With
`--mode interleaved` all rows share ONE job instead and their iterations alternate, so a machine
whose load changes (other tenants) slows every row alike. Rows:

    megatron     full-rank model, Megatron TP                      (paper: FullRank-TP)
    vanilla      low-rank model (r = d/4), Megatron TP per factor  (paper: Vanilla-TP)
    btp          low-rank model, bottleneck-aware TP               (paper: BOOST); --rmsnorm both
                 gives one row with Online RMSNorm and one with Sync RMSNorm

Unlike the public artifact's run_iter_compare.sh (log parsing, 10 iterations, first 2 dropped,
mean of 8), iterations are timed here with time.perf_counter between barriers on every rank
(torch.cuda.synchronize on GPU), each iteration is as long as its slowest rank, and the table gives
mean +- sample std, median, the speedups with their standard errors, and `--rounds` repeats the
whole comparison in rotated order (separate launches) to average out a drifting machine load.

TP bytes per block per pass come from the comm ledger on one decoder block (forward and backward
separately), next to the Table 6 closed form; TP collectives and bytes per iteration from the
ledger over whole timed iterations; "CPU ms/iter" is the process CPU time of an iteration (max
over ranks), which other tenants' load barely changes; peak memory is the CUDA allocator peak on
GPU and the peak RSS of each process on CPU (max over ranks; it includes the Python/torch
runtime; not split per row in interleaved mode on CPU).
Strategies not registered in nanotron_ext.models.tp_strategy give a "not available" row.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import Int, Names, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

STRATEGIES = ("megatron", "vanilla", "btp")
LABELS = {"megatron": "megatron (full rank)", "vanilla": "vanilla low-rank TP", "btp": "BOOST btp"}
TITLE = "BOOST iteration comparison"
_FIG6 = "LLaMA 1B-30B, TP up to 4 (+PP), bz=4, seq 4k, GPU"


def variant_name(strategy: str, rmsnorm: Optional[str]) -> str:
    return f"{LABELS[strategy]} ({rmsnorm} RMSNorm)" if rmsnorm else LABELS[strategy]


# Sec. 5.3 / Figure 6 (left): BOOST up to 1.91x over FullRank-TP and 2.28x over Vanilla-TP (the
# abstract: 1.46-1.91x and 1.87-2.27x); FullRank-TP beats Vanilla-TP by ~25% from 3B on 2 GPUs up.
# Online vs Sync RMSNorm (Sec. 5.6, Fig. 8 right): Online is the faster option, no number given.
CLAIMS = [
    bp.PaperClaim("BOOST (online) vs vanilla low-rank TP", "speedup_vs_vanilla", 2.28, ">", 1.0,
                  err_column="speedup_vs_vanilla_err",
                  where={"name": variant_name("btp", "online")}, source="Fig. 6 (left)", setting=_FIG6 + ", up to"),
    bp.PaperClaim("BOOST (online) vs full-rank Megatron TP", "speedup_vs_megatron", 1.91, ">", 1.0,
                  err_column="speedup_vs_megatron_err",
                  where={"name": variant_name("btp", "online")}, source="Fig. 6 (left)", setting=_FIG6 + ", up to"),
    bp.PaperClaim("BOOST (sync) vs vanilla low-rank TP", "speedup_vs_vanilla", None, ">", 1.0,
                  err_column="speedup_vs_vanilla_err",
                  where={"name": variant_name("btp", "sync")}, source="Fig. 6 (left)", setting=_FIG6),
    bp.PaperClaim("vanilla low-rank TP vs full rank (~25% slower)", "speedup_vs_megatron", 1 / 1.25, "<", 1.0,
                  err_column="speedup_vs_megatron_err",
                  where={"name": variant_name("vanilla", None)}, source="Fig. 6 (left)", setting=_FIG6),
    bp.PaperClaim("Online vs Sync RMSNorm: sync time / online time", "speedup_vs_sync", None, ">=", 1.0,
                  err_column="speedup_vs_sync_err",
                  where={"name": variant_name("btp", "online")}, source="Fig. 8 (right)", setting="7B/13B, GPU"),
]


# ------------------------------------------------------------------------------------------------
# pure table building (unit-tested)
# ------------------------------------------------------------------------------------------------
def build_rows(results: Sequence[Dict[str, Any]], warmup: int) -> List[Dict[str, Any]]:
    """One output row per compared variant, with statistics and speedups.

    Each result: {"name", "strategy", "status" ("ok" or a reason), and for "ok": "rounds" and
    "cpu_rounds" (per round, the per-iteration wall / process-CPU seconds), "block" ({"fwd"/"bwd":
    {"bytes", "calls"}}), "tp_calls_per_iter", "tp_bytes_per_iter", "peak_memory_bytes" (None when
    not attributable), "shape" ({"b", "s", "d", "d_ff", "r", "elem_bytes"})}.
    Speedups are against the vanilla row (the first one that ran) and the megatron row.
    """
    rows: List[Dict[str, Any]] = []
    for res in results:
        row: Dict[str, Any] = {"name": res["name"], "strategy": res["strategy"], "status": res["status"]}
        if res["status"] == "ok":
            s = bt.pooled_summary(res["rounds"], warmup)
            cpu = bt.pooled_summary(res["cpu_rounds"], warmup)
            shape = res["shape"]
            closed = bc.table6_tp_elements(res["strategy"], shape["b"], shape["s"], shape["d"], shape["d_ff"],
                                           shape["r"], shape.get("kv")) * shape["elem_bytes"]
            row.update({
                "summary": s, "mean_s": s.mean, "std_s": s.std, "median_s": s.median, "min_s": s.min, "n": s.n,
                "cpu_summary": cpu, "cpu_mean_s": cpu.mean, "cpu_std_s": cpu.std,
                "tp_fwd_bytes_per_block": res["block"]["fwd"]["bytes"],
                "tp_bwd_bytes_per_block": res["block"]["bwd"]["bytes"],
                "tp_fwd_calls_per_block": res["block"]["fwd"]["calls"],
                "tp_bwd_calls_per_block": res["block"]["bwd"]["calls"],
                "table6_bytes_per_block_per_pass": closed,
                "tp_calls_per_iter": res["tp_calls_per_iter"], "tp_bytes_per_iter": res["tp_bytes_per_iter"],
                "peak_memory_bytes": res["peak_memory_bytes"],
            })
        rows.append(row)
    ok = [r for r in rows if r["status"] == "ok"]
    refs = {key: next((r["summary"] for r in ok if r["strategy"] == key), None) for key in ("vanilla", "megatron")}
    for r in ok:
        for key, ref in refs.items():
            sp = bt.speedup(ref, r["summary"]) if ref is not None else None
            r[f"speedup_vs_{key}"] = sp[0] if sp else None
            r[f"speedup_vs_{key}_err"] = sp[1] if sp else None
    add_sync_ratio(rows)
    return rows


def add_sync_ratio(rows: Sequence[Dict[str, Any]]) -> None:
    """On the online-RMSNorm btp row: sync row's mean / online row's mean (> 1: online faster)."""
    by = {r["name"]: r for r in rows if r["status"] == "ok"}
    on, sy = by.get(variant_name("btp", "online")), by.get(variant_name("btp", "sync"))
    for r in rows:
        r.setdefault("speedup_vs_sync", None)
        r.setdefault("speedup_vs_sync_err", None)
    if on is not None and sy is not None:
        on["speedup_vs_sync"], on["speedup_vs_sync_err"] = bt.speedup(sy["summary"], on["summary"])


def restore_summaries(rows: Sequence[Dict[str, Any]]) -> None:
    """Rebuild the Summary objects a saved table dropped (max is not saved: nan)."""
    nan = float("nan")
    for r in rows:
        if r["status"] == "ok" and "summary" not in r:
            r["summary"] = bt.Summary(r["n"], r["mean_s"], r["std_s"], r["median_s"], r["min_s"], nan)
            r["cpu_summary"] = bt.Summary(r["n"], r["cpu_mean_s"], r["cpu_std_s"], nan, nan, nan)


def _strip(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("summary")}


def render(rows: Sequence[Dict[str, Any]]) -> str:
    return br.format_table(*table(rows))


def table(rows: Sequence[Dict[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    """(headers, body); the ledger's forward bytes sit beside Table 6's closed form and each speedup
    beside the paper's (run `annotate` first)."""
    headers = ["strategy", "iter ms mean +- std", "median ms", "CPU ms/iter", "TP fwd KiB/block", "TP bwd KiB/block",
               "Table 6 KiB/block/pass", "TP calls/iter", "TP MiB/iter", "peak MiB", "vs vanilla", "paper",
               "vs full rank", "paper"]
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["name"], r["status"]] + [None] * (len(headers) - 2))
            continue
        out.append([
            r["name"], br.fmt_time_ms(r["summary"]), f"{r['median_s'] * 1e3:,.1f}", br.fmt_time_ms(r["cpu_summary"]),
            br.fmt_bytes(r["tp_fwd_bytes_per_block"]), br.fmt_bytes(r["tp_bwd_bytes_per_block"]),
            br.fmt_bytes(r["table6_bytes_per_block_per_pass"]), f"{r['tp_calls_per_iter']:g}",
            br.fmt_bytes(r["tp_bytes_per_iter"], "MiB"), br.fmt_bytes(r["peak_memory_bytes"], "MiB"),
            _ratio(r, "vanilla"), br.fmt_x(r.get("paper_speedup_vs_vanilla")),
            _ratio(r, "megatron"), br.fmt_x(r.get("paper_speedup_vs_megatron")),
        ])
    return headers, out


def _ratio(row: Dict[str, Any], key: str) -> Optional[str]:
    v = row.get(f"speedup_vs_{key}")
    return None if v is None else br.fmt_ratio((v, row[f"speedup_vs_{key}_err"]))


def verdicts(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The issue's targets, checked on the measured means."""
    by = {r["name"]: r for r in rows if r["status"] == "ok"}
    van = next((r for r in by.values() if r["strategy"] == "vanilla"), None)
    out = []
    for r in by.values():
        if r["strategy"] == "btp" and van is not None:
            met = r["mean_s"] < van["mean_s"]
            out.append(f"{r['name']}: {r['mean_s'] * 1e3:.1f} ms vs vanilla {van['mean_s'] * 1e3:.1f} ms "
                       f"-> target 'BOOST below vanilla' {'MET' if met else 'NOT met'}")
    on, sy = by.get(variant_name("btp", "online")), by.get(variant_name("btp", "sync"))
    if on is not None and sy is not None:
        ratio, err = bt.speedup(sy["summary"], on["summary"])
        met = on["mean_s"] <= sy["mean_s"]
        out.append(f"Online vs Sync RMSNorm: sync/online = {ratio:.3f} +- {err:.3f} -> target 'online no slower' "
                   f"{'MET' if met else 'NOT met'}"
                   f"{'' if abs(ratio - 1) > 2 * err else ' (within noise: |1 - ratio| <= 2 s.e.)'}")
    return out


# ------------------------------------------------------------------------------------------------
# orchestrator
# ------------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace) -> List[Tuple[str, str, Optional[str]]]:
    """(row name, strategy, rmsnorm) in table order."""
    out = []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        if strategy not in STRATEGIES:
            from nanotron_ext.cli_checks import ArgumentError  # (was exit code 1)

            raise ArgumentError(f"--strategies: unknown {strategy!r}; choose from {', '.join(STRATEGIES)}")
        if strategy == "btp":
            for mode in (("online", "sync") if args.rmsnorm == "both" else (args.rmsnorm,)):
                out.append((variant_name(strategy, mode), strategy, mode))
        else:
            out.append((variant_name(strategy, None), strategy, None))
    return out


def shape_of(cfg: Any) -> Dict[str, int]:
    m, t = cfg.model, cfg.tokens
    return {"b": t.micro_batch_size, "s": t.sequence_length, "d": m.hidden_size, "d_ff": m.ffn_size,
            "r": m.low_rank.width(m.hidden_size), "kv": bc.kv_width(m), "layers": m.num_layers, "elem_bytes": 2
            if m.dtype == "bf16" else 4}


def orchestrate(args: argparse.Namespace, torchrun_args: List[str]) -> List[Dict[str, Any]]:
    from nanotron_ext.config.loader import save_config

    registered, why = bw.available_strategies()
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    work = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="boost_iter_compare_"))
    work.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Dict[str, Any]] = {}
    runnable = []
    for name, strategy, rmsnorm in plan(args):
        res: Dict[str, Any] = {"name": name, "strategy": strategy, "rmsnorm": rmsnorm, "rounds": [], "cpu_rounds": []}
        results[name] = res
        if strategy not in registered:
            res["status"] = f"not available (tp_strategy {strategy!r} not registered" + (f"; {why})" if why else ")")
            continue
        try:
            cfg = bw.resolve_config(args.config_file, shared + bc.strategy_overrides(strategy, kind, rmsnorm))
        except Exception as e:  # noqa: BLE001 - a bad shape for one strategy is a row, not a crash
            res["status"] = f"config error: {e}"
            continue
        path = work / f"{strategy}{'_' + rmsnorm if rmsnorm else ''}.yaml"
        save_config(cfg, path)
        res.update(status="ok", config_path=str(path), shape=shape_of(cfg), low_rank_kind=cfg.model.low_rank.kind)
        runnable.append(name)
    script = Path(__file__).resolve()
    for rnd in range(args.rounds):
        shift = rnd % max(1, len(runnable))
        order = runnable[shift:] + runnable[:shift]  # rotated: no row always runs first
        # separate: one torchrun job per row; interleaved: one job, iterations alternate between rows
        jobs = [[n] for n in order] if args.mode == "separate" else ([order] if order else [])
        for names in jobs:
            out_file = work / f"result_{'+'.join(Path(results[n]['config_path']).stem for n in names)}_r{rnd}.json"
            log = work / f"log_{out_file.stem}.txt"
            worker_args = ["--worker", "--mode", args.mode, "--configs", *[results[n]["config_path"] for n in names],
                           "--names", *names, "--iters", str(args.iters), "--warmup", str(args.warmup),
                           "--result-file", str(out_file)]
            print(f"[round {rnd + 1}/{args.rounds}] {' | '.join(names)} ...", file=sys.stderr, flush=True)
            rc, tail = bl.launch(script, worker_args, torchrun_args, log, args.timeout, args.verbose)
            if rc != 0 or not out_file.exists():
                for n in names:
                    results[n]["status"] = f"failed (rc={rc}): {bl.last_error_line(tail)} [log: {log}]"
                continue
            got = bl.read_result(out_file)
            for row in got["rows"]:
                res = results[row["name"]]
                res["rounds"].append(row["times"])
                res["cpu_rounds"].append(row["cpu_times"])
                res["block"] = row["block"]
                res["tp_calls_per_iter"] = row["tp_calls_per_iter"]
                res["tp_bytes_per_iter"] = row["tp_bytes_per_iter"]
                peak = row["peak_memory_bytes"]
                res["peak_memory_bytes"] = None if peak is None else max(res.get("peak_memory_bytes") or 0, peak)
                res["meta"] = got["meta"]
    return [results[n] for n, _, _ in plan(args)]


# ------------------------------------------------------------------------------------------------
# worker (under torchrun)
# ------------------------------------------------------------------------------------------------
def _summary_row(t: bt.Timings, warmup: int) -> Dict[str, Any]:
    import statistics

    kept = t.comm[warmup:]
    return {"times": t.wall, "cpu_times": t.cpu,
            "tp_calls_per_iter": statistics.fmean(c["calls"] for c in kept),
            "tp_bytes_per_iter": statistics.fmean(c["bytes"] for c in kept)}


def measure_separate(cfg: Any, ctx: Any, iters: int, warmup: int) -> Dict[str, Any]:
    """Time `iters` training iterations of the one model `cfg` describes; comm and memory beside."""
    from nanotron_ext.parallel.comm import get_ledger

    t = bw.build_trainee(cfg, ctx)
    batches = bw.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica)
    bw.reset_peak(ctx.device)
    timings = bt.timed(lambda: bw.train_iteration(t, ctx, batches), ctx.device, iters, ledger=get_ledger())
    row = _summary_row(timings, warmup)
    row["peak_memory_bytes"] = max(bl.gather_to_main(bw.peak_memory()))
    row["block"] = bc.block_comm(cfg, t.model, ctx, cfg.tokens.micro_batch_size)
    bw.release(t)
    return row


def measure_interleaved(cfgs: Sequence[Any], ctx: Any, iters: int, warmup: int) -> List[Dict[str, Any]]:
    """All models built side by side; iteration i of every model runs before iteration i+1 of any,
    so a load change on a shared machine hits every row alike. Peak memory per row only on CUDA
    (the allocator peak is reset around each row's iterations; RSS cannot be split by model)."""
    from nanotron_ext.parallel.comm import get_ledger

    trainees = [bw.build_trainee(cfg, ctx) for cfg in cfgs]
    batches = [bw.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica) for cfg in cfgs]
    timings = [bt.Timings([], [], []) for _ in cfgs]
    cuda = ctx.device.type == "cuda"
    peaks = [0] * len(cfgs)
    for _ in range(iters):
        for i, (t, b) in enumerate(zip(trainees, batches)):
            bw.reset_peak(ctx.device)
            timings[i].extend(bt.timed(lambda t=t, b=b: bw.train_iteration(t, ctx, b), ctx.device, 1,
                                       ledger=get_ledger()))
            if cuda:
                peaks[i] = max(peaks[i], bw.peak_memory())
    rows = []
    for i, (cfg, t) in enumerate(zip(cfgs, trainees)):
        row = _summary_row(timings[i], warmup)
        row["peak_memory_bytes"] = max(bl.gather_to_main(peaks[i])) if cuda else None
        row["block"] = bc.block_comm(cfg, t.model, ctx, cfg.tokens.micro_batch_size)
        rows.append(row)
    bw.release(*trainees)
    return rows


def worker(args: argparse.Namespace) -> None:
    from nanotron_ext.config.loader import config_to_dict, load_config

    if args.iters <= args.warmup:
        raise ValueError(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    cfgs = [load_config(p) for p in args.configs]
    names = args.names or args.configs
    ctx = bl.init_distributed(cfgs[0])
    for name, cfg in zip(names, cfgs):
        bl.adapt_layout(cfg, ctx.world_pg.size())
        if (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) != (ctx.dp_pg.size(),
                                                                            ctx.tp_pg.size(), ctx.pp_pg.size()):
            raise ValueError(f"{name}: every config of one launch must share the parallel layout")
    if args.mode == "interleaved":
        measured = measure_interleaved(cfgs, ctx, args.iters, args.warmup)
    else:
        measured = [measure_separate(cfg, ctx, args.iters, args.warmup) for cfg in cfgs]
    rows = [{"name": n, "config": config_to_dict(c)["model"], **m} for n, c, m in zip(names, cfgs, measured)]
    bl.write_worker_result(args.result_file, {"rows": rows, "meta": bl.worker_meta(ctx)})


# ------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_run_args(p, iters=12, warmup=2, out="runs/boost/iter_compare.json")
    p.add_argument("--strategies", default=",".join(STRATEGIES), type=Names(STRATEGIES),
                   help="rows to compare (default: all three)")
    p.add_argument("--rmsnorm", choices=["online", "sync", "both"], default="both",
                   help="RMSNorm mode(s) of the btp rows (default both: one row each)")
    p.add_argument("--mode", choices=["separate", "interleaved"], default="separate",
                   help="separate: one torchrun job per row (default); interleaved: one job, the rows' "
                        "iterations alternate (fair on a machine whose load changes; CPU peak memory not split)")
    p.add_argument("--rounds", type=Int(1), default=1,
                   help="repeat the comparison this many times (fresh launches, rotated order) and pool")
    bw.add_model_args(p)
    br.help_with_defaults(p)
    return p.parse_args(argv)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(own)
    done = bl.early_phase(args, worker, lambda saved: republish(saved, args.out))
    if done is not None:
        return done
    results = orchestrate(args, torchrun_args)
    rows = build_rows(results, args.warmup)
    meta_src = next((r.get("meta") for r in results if r.get("meta")), None) or br.run_meta()
    shape = next((r["shape"] for r in results if r.get("shape")), {})
    kind = next((r.get("low_rank_kind") for r in results if r.get("strategy") != "megatron"
                 and r.get("low_rank_kind")), None)
    meta = {**meta_src, "shape": shape, "low_rank_kind": kind, "iters": args.iters, "warmup": args.warmup,
            "rounds": args.rounds, "mode": args.mode, "torchrun_args": torchrun_args or ["--nproc_per_node", "2"]}
    publish(rows, meta, args.out)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not available") for r in rows) else 1


def republish(saved: Dict[str, Any], out: Optional[str]) -> int:
    """--from-json: the summaries and sync ratios a saved result keeps as plain values, then publish."""
    restore_summaries(saved["rows"])
    add_sync_ratio(saved["rows"])
    return publish(saved["rows"], saved["meta"], out)


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: Optional[str]) -> int:
    """Print the table with the paper column, the issue's targets and the paper's verdicts; write
    JSON + markdown (or CSV) with --out."""
    bp.annotate(rows, CLAIMS)
    paper_verdicts = bp.evaluate(CLAIMS, rows)
    shape = meta.get("shape", {})
    print(f"{TITLE} on {meta.get('machine')}, world {meta.get('world_size', '?')} (dp {meta.get('dp', '?')} x "
          f"tp {meta.get('tp', '?')} x pp {meta.get('pp', '?')}), {meta.get('date')}")
    print(f"model: d={shape.get('d')} d_ff={shape.get('d_ff')} r={shape.get('r')} low-rank={meta.get('low_rank_kind')} "
          f"layers={shape.get('layers')}; micro-batch {shape.get('b')} x seq {shape.get('s')}; {meta.get('iters')} "
          f"iterations, first {meta.get('warmup')} dropped, {meta.get('rounds')} round(s), {meta.get('mode')}; "
          f"1-min load avg at start {meta.get('loadavg_1m')}")
    headers, body = table(rows)
    print(br.format_table(headers, body))
    for line in verdicts(rows) + bp.verdict_lines(paper_verdicts):
        print(line)
    note = ("TP KiB/block: one decoder block's TP collective payload on one rank (ledger); Table 6 is the paper's "
            "per-pass closed form (norms omitted; GQA form for vanilla when kv heads < heads). Peak MiB: " +
            ("CUDA max allocated." if "cuda" in str(meta.get("device", "")) else
             "peak RSS of one process (CPU), runtime included" +
             (" (not split per row in interleaved mode)." if meta.get("mode") == "interleaved" else ".")))
    print(note)
    if out:
        written = br.write_report(out, [_strip(r) for r in rows], meta, TITLE, headers, body,
                                  verdicts=paper_verdicts, notes=[note, *verdicts(rows)])
        print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
