"""Iteration time of full-rank Megatron TP, vanilla low-rank TP and BOOST (BTP) on one model shape.

    python benchmarks/boost_iter_compare.py [options] [-- torchrun options]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

STRATEGIES = ("megatron", "vanilla", "btp")
LABELS = {"megatron": "megatron (full rank)", "vanilla": "vanilla low-rank TP", "btp": "BOOST btp"}


# ------------------------------------------------------------------------------------------------
# pure table building (unit-tested)
# ------------------------------------------------------------------------------------------------
def pooled_summary(rounds: Sequence[Sequence[float]], warmup: int) -> bc.Summary:
    """Drop `warmup` iterations of EACH round (each is a fresh launch), summarise what is left."""
    kept: List[float] = []
    for times in rounds:
        kept += list(times)[warmup:]
    return bc.summarize(kept, 0)


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
            s = pooled_summary(res["rounds"], warmup)
            cpu = pooled_summary(res["cpu_rounds"], warmup)
            shape = res["shape"]
            closed = bc.table6_tp_elements(res["strategy"], shape["b"], shape["s"], shape["d"], shape["d_ff"],
                                           shape["r"]) * shape["elem_bytes"]
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
            sp = bc.speedup(ref, r["summary"]) if ref is not None else None
            r[f"speedup_vs_{key}"] = sp[0] if sp else None
            r[f"speedup_vs_{key}_err"] = sp[1] if sp else None
    return rows


def _strip(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("summary")}


def render(rows: Sequence[Dict[str, Any]]) -> str:
    headers = ["strategy", "iter ms mean +- std", "median ms", "CPU ms/iter", "TP fwd KiB/block", "TP bwd KiB/block",
               "Table 6 KiB/block/pass", "TP calls/iter", "TP MiB/iter", "peak MiB", "vs vanilla", "vs full rank"]
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["name"], r["status"]] + [None] * (len(headers) - 2))
            continue
        out.append([
            r["name"], bc.fmt_time_ms(r["summary"]), f"{r['median_s'] * 1e3:,.1f}", bc.fmt_time_ms(r["cpu_summary"]),
            bc.fmt_bytes(r["tp_fwd_bytes_per_block"]), bc.fmt_bytes(r["tp_bwd_bytes_per_block"]),
            bc.fmt_bytes(r["table6_bytes_per_block_per_pass"]), f"{r['tp_calls_per_iter']:g}",
            bc.fmt_bytes(r["tp_bytes_per_iter"], "MiB"), bc.fmt_bytes(r["peak_memory_bytes"], "MiB"),
            _ratio(r, "vanilla"), _ratio(r, "megatron"),
        ])
    return bc.format_table(headers, out)


def _ratio(row: Dict[str, Any], key: str) -> Optional[str]:
    v = row.get(f"speedup_vs_{key}")
    return None if v is None else bc.fmt_ratio((v, row[f"speedup_vs_{key}_err"]))


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
        ratio, err = bc.speedup(sy["summary"], on["summary"])
        met = on["mean_s"] <= sy["mean_s"]
        out.append(f"Online vs Sync RMSNorm: sync/online = {ratio:.3f} +- {err:.3f} -> target 'online no slower' "
                   f"{'MET' if met else 'NOT met'}{'' if abs(ratio - 1) > 2 * err else ' (within noise: |1 - ratio| <= 2 s.e.)'}")
    return out


# ------------------------------------------------------------------------------------------------
# orchestrator
# ------------------------------------------------------------------------------------------------
def variant_name(strategy: str, rmsnorm: Optional[str]) -> str:
    return f"{LABELS[strategy]} ({rmsnorm} RMSNorm)" if rmsnorm else LABELS[strategy]


def plan(args: argparse.Namespace) -> List[Tuple[str, str, Optional[str]]]:
    """(row name, strategy, rmsnorm) in table order."""
    out = []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        if strategy not in STRATEGIES:
            raise SystemExit(f"--strategies: unknown {strategy!r}; choose from {', '.join(STRATEGIES)}")
        if strategy == "btp":
            for mode in (("online", "sync") if args.rmsnorm == "both" else (args.rmsnorm,)):
                out.append((variant_name(strategy, mode), strategy, mode))
        else:
            out.append((variant_name(strategy, None), strategy, None))
    return out


def shape_of(cfg: Any) -> Dict[str, int]:
    m, t = cfg.model, cfg.tokens
    return {"b": t.micro_batch_size, "s": t.sequence_length, "d": m.hidden_size, "d_ff": m.ffn_size,
            "r": m.rank, "layers": m.num_layers, "elem_bytes": 2 if m.dtype == "bf16" else 4}


def orchestrate(args: argparse.Namespace, torchrun_args: List[str]) -> List[Dict[str, Any]]:
    from nanotron_ext.config.loader import save_config

    registered, why = bc.available_strategies()
    shared = bc.shape_overrides(args) + list(args.overrides)
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
            cfg = bc.resolve_config(args.config_file, shared + bc.strategy_overrides(strategy, kind, rmsnorm))
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
            rc, tail = bc.launch(script, worker_args, torchrun_args, log, args.timeout, args.verbose)
            if rc != 0 or not out_file.exists():
                for n in names:
                    results[n]["status"] = f"failed (rc={rc}): {bc.last_error_line(tail)} [log: {log}]"
                continue
            got = bc.read_result(out_file)
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
def _summary_row(t: bc.Timings, warmup: int) -> Dict[str, Any]:
    import statistics

    kept = t.comm[warmup:]
    return {"times": t.wall, "cpu_times": t.cpu,
            "tp_calls_per_iter": statistics.fmean(c["calls"] for c in kept),
            "tp_bytes_per_iter": statistics.fmean(c["bytes"] for c in kept)}


def measure_separate(cfg: Any, ctx: Any, iters: int, warmup: int) -> Dict[str, Any]:
    """Time `iters` training iterations of the one model `cfg` describes; comm and memory beside."""
    from nanotron_ext.parallel.comm import get_ledger

    t = bc.build_trainee(cfg, ctx)
    batches = bc.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica)
    bc.reset_peak(ctx.device)
    timings = bc.timed(lambda: bc.train_iteration(t, ctx, batches), ctx.device, iters, ledger=get_ledger())
    row = _summary_row(timings, warmup)
    row["peak_memory_bytes"] = max(bc.gather_to_main(bc.peak_memory()))
    row["block"] = bc.block_comm(cfg, t.model, ctx, cfg.tokens.micro_batch_size)
    bc.release(t)
    return row


def measure_interleaved(cfgs: Sequence[Any], ctx: Any, iters: int, warmup: int) -> List[Dict[str, Any]]:
    """All models built side by side; iteration i of every model runs before iteration i+1 of any,
    so a load change on a shared machine hits every row alike. Peak memory per row only on CUDA
    (the allocator peak is reset around each row's iterations; RSS cannot be split by model)."""
    from nanotron_ext.parallel.comm import get_ledger

    trainees = [bc.build_trainee(cfg, ctx) for cfg in cfgs]
    batches = [bc.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica) for cfg in cfgs]
    timings = [bc.Timings([], [], []) for _ in cfgs]
    cuda = ctx.device.type == "cuda"
    peaks = [0] * len(cfgs)
    for _ in range(iters):
        for i, (t, b) in enumerate(zip(trainees, batches)):
            bc.reset_peak(ctx.device)
            timings[i].extend(bc.timed(lambda: bc.train_iteration(t, ctx, b), ctx.device, 1, ledger=get_ledger()))
            if cuda:
                peaks[i] = max(peaks[i], bc.peak_memory())
    rows = []
    for i, (cfg, t) in enumerate(zip(cfgs, trainees)):
        row = _summary_row(timings[i], warmup)
        row["peak_memory_bytes"] = max(bc.gather_to_main(peaks[i])) if cuda else None
        row["block"] = bc.block_comm(cfg, t.model, ctx, cfg.tokens.micro_batch_size)
        rows.append(row)
    bc.release(*trainees)
    return rows


def worker(args: argparse.Namespace) -> None:
    from nanotron_ext.config.loader import config_to_dict, load_config

    if args.iters <= args.warmup:
        raise ValueError(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    cfgs = [load_config(p) for p in args.configs]
    names = args.names or args.configs
    ctx = bc.init_distributed(cfgs[0])
    for name, cfg in zip(names, cfgs):
        bc.adapt_layout(cfg, ctx.world_pg.size())
        if (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) != (ctx.dp_pg.size(), ctx.tp_pg.size(), ctx.pp_pg.size()):
            raise ValueError(f"{name}: every config of one launch must share the parallel layout")
    if args.mode == "interleaved":
        measured = measure_interleaved(cfgs, ctx, args.iters, args.warmup)
    else:
        measured = [measure_separate(cfg, ctx, args.iters, args.warmup) for cfg in cfgs]
    rows = [{"name": n, "config": config_to_dict(c)["model"], **m} for n, c, m in zip(names, cfgs, measured)]
    bc.write_worker_result(args.result_file, {"rows": rows, "meta": bc.common_worker_meta(cfgs[0], ctx)})


# ------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=12, help="training iterations per row (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="leading iterations dropped (default 2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="rows to compare (default: all three)")
    p.add_argument("--rmsnorm", choices=["online", "sync", "both"], default="both",
                   help="RMSNorm mode(s) of the btp rows (default both: one row each)")
    p.add_argument("--mode", choices=["separate", "interleaved"], default="separate",
                   help="separate: one torchrun job per row (default); interleaved: one job, the rows' "
                        "iterations alternate (fair on a machine whose load changes; CPU peak memory not split)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the comparison this many times (fresh launches, rotated order) and pool")
    p.add_argument("--out", help="write the table as JSON (or CSV when the name ends in .csv)")
    p.add_argument("--log-dir", help="keep resolved configs, worker logs and raw results here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun job")
    p.add_argument("--verbose", action="store_true", help="stream worker output")
    bc.add_model_args(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--names", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bc.split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(own)
    if args.worker:
        worker(args)
        return 0
    if args.iters <= args.warmup:
        raise SystemExit(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    results = orchestrate(args, torchrun_args)
    rows = build_rows(results, args.warmup)
    meta_src = next((r.get("meta") for r in results if r.get("meta")), None) or bc.run_meta()
    shape = next((r["shape"] for r in results if r.get("shape")), {})
    kind = next((r.get("low_rank_kind") for r in results if r.get("strategy") != "megatron" and r.get("low_rank_kind")), None)
    title = (f"BOOST iteration comparison on {meta_src.get('machine')}, world {meta_src.get('world_size', '?')} "
             f"(dp {meta_src.get('dp', '?')} x tp {meta_src.get('tp', '?')} x pp {meta_src.get('pp', '?')}), "
             f"{meta_src.get('date')}")
    print(title)
    print(f"model: d={shape.get('d')} d_ff={shape.get('d_ff')} r={shape.get('r')} low-rank={kind} "
          f"layers={shape.get('layers')}; "
          f"micro-batch {shape.get('b')} x seq {shape.get('s')}; "
          f"{args.iters} iterations, first {args.warmup} dropped, {args.rounds} round(s), {args.mode}; "
          f"1-min load avg at start {meta_src.get('loadavg_1m')}")
    print(render(rows))
    for line in verdicts(rows):
        print(line)
    print("TP KiB/block: one decoder block's TP collective payload on one rank (ledger); Table 6 is the paper's "
          "per-pass closed form (MHA, norms omitted). Peak MiB: " +
          ("CUDA max allocated." if "cuda" in str(meta_src.get("device", "")) else
           "peak RSS of one process (CPU), runtime included" +
           (" (not split per row in interleaved mode)." if args.mode == "interleaved" else ".")))
    if args.out:
        out_rows = [_strip(r) for r in rows]
        path = bc.write_rows(args.out, out_rows, {**meta_src, "shape": shape, "low_rank_kind": kind, "iters": args.iters,
                                                  "warmup": args.warmup, "rounds": args.rounds, "mode": args.mode,
                                                  "torchrun_args": torchrun_args or ["--nproc_per_node", "2"]})
        print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not available") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
