"""BOOST Table 4: per-TP-rank memory breakdown (weights, gradients, optimizer states, activations).

    python reproduce/boost/table4_memory.py [options] [-- torchrun options]   (default 2 CPU ranks, TP=2)

One torchrun job builds, in turn, the full-rank model under Megatron TP, the low-rank model under
vanilla TP and under BTP (same shape and batch), and on every rank measures:

    weights     bytes of this rank's parameters (tied ones once)
    grads       bytes of this rank's .grad tensors after a forward/backward
    optimizer   bytes of this rank's AdamW state after one step
    act (alloc) bytes the allocator still holds after one micro-batch forward (torch.profiler
                profile_memory: CPU and CUDA alike; includes everything kept for backward)
    act (saved) bytes of distinct storages saved for backward (saved_tensors_hooks, parameters and
                buffers excluded, plus the inputs checkpoint frames keep): device-independent
    cuda peak   on GPU only: torch.cuda.max_memory_allocated over forward+backward minus the
                weights+grads+optimizer held before it

The table shows TP rank 0 and, per column, the max over ranks. Paper (CoLA LLaMA-7B, bz=4,
seq 4k, TP=4, GB): vanilla 1.25/1.25/2.50/30.73, BOOST 1.25/1.25/2.50/22.14 (weights/grads/opt/act).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: make `reproduce` importable

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import paper as bp  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import timing as bt  # noqa: E402
from nanotron_ext.bench import workload as bw  # noqa: E402
from nanotron_ext.cli_flags import Names, Parser, one_line_refusals  # noqa: E402
from reproduce.boost import common as bc  # noqa: E402

STRATEGIES = ("megatron", "vanilla", "btp")
NAMES = {"megatron": "megatron (full rank)", "vanilla": "vanilla low-rank TP", "btp": "BOOST btp"}
COLUMNS = ("weights", "grads", "optimizer", "act_alloc", "act_saved", "cuda_peak_act")
TITLE = "BOOST Table 4: memory per TP rank"
_GPU = "CoLA LLaMA-7B, bz=4, seq 4k, TP=4, GPU"
# Table 4 (GB per TP rank): weights, grads, optimizer, activations + others, total; no full-rank row
PAPER_GB = {NAMES["vanilla"]: {"weights": 1.25, "grads": 1.25, "optimizer": 2.50, "act_alloc": 30.73, "total": 35.73},
            NAMES["btp"]: {"weights": 1.25, "grads": 1.25, "optimizer": 2.50, "act_alloc": 22.14, "total": 27.14}}
# saved-tensor and allocator bytes of one step are deterministic for a given shape: one measurement decides
CLAIMS = [
    bp.PaperClaim("BOOST activations / vanilla's (28% below)", "act_vs_vanilla", 22.14 / 30.73, "<", 1.0,
                  where={"name": NAMES["btp"]}, exact=True, source="Table 4", setting=_GPU),
    bp.PaperClaim("BOOST total / vanilla's", "total_vs_vanilla", 27.14 / 35.73, "<", 1.0,
                  where={"name": NAMES["btp"]}, exact=True, source="Table 4", setting=_GPU),
    # "the choice of TP strategy does not affect the persistent memory": equal, and BTP never more
    bp.PaperClaim("BOOST weights+grads+optimizer / vanilla's", "persistent_vs_vanilla", 1.0, "<=", 1.0,
                  where={"name": NAMES["btp"]}, exact=True, source="Table 4", setting=_GPU),
]


def measure(cfg: Any, ctx: Any) -> Dict[str, Optional[int]]:
    """This rank's memory breakdown for the model `cfg` describes."""
    import torch

    from nanotron_ext.train.pipeline_step import forward_backward

    if ctx.pp_pg.size() != 1:
        raise ValueError("table4_memory measures one stage holding the whole model: use pp = 1")
    t = bw.build_trainee(cfg, ctx)
    mb = bw.random_micro_batches(cfg, 1)[0]
    ids, labels = mb["input_ids"].to(ctx.device), mb["label_ids"].to(ctx.device)
    out: Dict[str, Optional[int]] = {}
    # one full iteration first: gradients and optimizer state exist afterwards, as in training
    with bw.autocast_for(cfg, ctx.device):
        forward_backward(t.model, t.engine, [mb], ctx)
    out["grads"] = bw.persistent_bytes(t.model, None)["grads"]
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    persistent = bw.persistent_bytes(t.model, t.optimizer)
    out["weights"], out["optimizer"] = persistent["weights"], persistent["optimizer"]
    bt.sync_all(ctx.device)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        bw.reset_peak(ctx.device)
    with bw.autocast_for(cfg, ctx.device):
        loss, act = bc.activation_bytes(t.model, lambda: t.model(input_ids=ids, label_ids=labels)["loss"], ctx.device)
    loss.backward()
    out["act_alloc"], out["act_saved"] = act["allocator"], act["saved"]
    out["cuda_peak_act"] = int(torch.cuda.max_memory_allocated() - base) if cuda else None
    t.optimizer.zero_grad(set_to_none=True)
    bw.release(t)
    return out


def worker(args: argparse.Namespace) -> None:
    names, cfgs, ctx = bl.worker_configs(args)
    rows = []
    for name, cfg in zip(names, cfgs):
        per_rank = bl.gather_to_main(measure(cfg, ctx))
        rows.append({"name": name, "rank0": per_rank[0],
                     "max_over_ranks": {k: (None if per_rank[0][k] is None else max(r[k] for r in per_rank))
                                        for k in COLUMNS}})
    bl.write_worker_result(args.result_file, {"rows": rows, "meta": bl.worker_meta(ctx)})


def add_ratios(rows: Sequence[Dict[str, Any]]) -> None:
    """Flat rank-0 totals and each row's ratios to the vanilla row (the quantities the claims check)."""
    for r in rows:
        r0 = r["rank0"]
        r["persistent"] = sum(r0[k] for k in ("weights", "grads", "optimizer"))
        r["total"] = r["persistent"] + r0["act_alloc"]
        r["act_alloc"] = r0["act_alloc"]
    van = next((r for r in rows if r["name"] == NAMES["vanilla"]), None)
    for r in rows:
        for k in ("act_alloc", "total", "persistent"):
            r[f"{k.replace('_alloc', '')}_vs_vanilla"] = bc.ratio(r[k], van[k]) if van else None


def table(rows: Sequence[Dict[str, Any]], unit: str) -> Tuple[List[str], List[List[Any]]]:
    """Rank-0 numbers (max over ranks in brackets where it differs) with the paper's GB beside each;
    total = persistent + act (alloc)."""
    headers = ["strategy"]
    for k in COLUMNS + ("total",):
        headers.append(f"{k.replace('_', ' ')} {unit}")
        if k not in ("act_saved", "cuda_peak_act"):
            headers.append("paper GB")
    headers += ["act / vanilla", "paper"]
    body = []
    for r in rows:
        r0, mx = r["rank0"], r["max_over_ranks"]
        paper = PAPER_GB.get(r["name"], {})
        cells: List[Any] = [r["name"]]
        for k in COLUMNS + ("total",):
            v = r[k] if k == "total" else r0[k]
            cell = br.fmt_bytes(v, unit) if v is not None else "-"
            if k != "total" and v is not None and mx[k] != v:
                cell += f" [{br.fmt_bytes(mx[k], unit)}]"
            cells.append(cell)
            if k not in ("act_saved", "cuda_peak_act"):
                cells.append(paper.get(k))
        cells += [br.fmt_x(r.get("act_vs_vanilla")), br.fmt_x(r.get("paper_act_vs_vanilla"))]
        body.append(cells)
    return headers, body


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bl.split_argv(sys.argv[1:] if argv is None else argv)
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bw.add_model_args(p)
    bl.add_run_args(p, iters=1, warmup=0, out="runs/boost/table4.json")
    p.add_argument("--strategies", default=",".join(STRATEGIES), type=Names(STRATEGIES),
                   help="rows (default: all three)")
    p.add_argument("--unit", choices=["KiB", "MiB", "GiB"], default="MiB")
    br.help_with_defaults(p)
    args = p.parse_args(own)
    done = bl.early_phase(args, worker, lambda saved: publish(saved["rows"], saved["meta"], args.out, args.unit),
                          check_iters=False)
    if done is not None:
        return done
    if args.config_file is None and args.micro_batch is None:
        args.micro_batch = 4  # the paper's Table 4 batch
    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = bw.require_strategies(wanted)
    shared = bw.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {NAMES[s]: bw.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind)) for s in strategies}
    result = bl.run_job(__file__, cfgs, [], torchrun_args, args.log_dir, args.timeout, args.verbose)
    c = next(iter(cfgs.values()))
    meta = {**result["meta"], "low_rank_kind": kind, "model_line": (
        f"d={c.model.hidden_size} d_ff={c.model.ffn_size} layers={c.model.num_layers} "
        f"r={c.model.low_rank.width(c.model.hidden_size)} low-rank={kind}; micro-batch {c.tokens.micro_batch_size} x "
        f"seq {c.tokens.sequence_length}; dtype {c.model.dtype}; AdamW")}
    for s in wanted:
        if s not in strategies:
            print(f"{NAMES[s]}: not available (tp_strategy not registered)")
    return publish(result["rows"], meta, args.out, args.unit)


def publish(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: Optional[str], unit: str) -> int:
    """Print the table with the paper column and the verdicts; write JSON + markdown with --out."""
    add_ratios(rows)
    bp.annotate(rows, CLAIMS)
    verdicts = bp.evaluate(CLAIMS, rows)
    print(f"{TITLE} on {meta['machine']}, tp={meta['tp']}, {meta['date']}")
    print(f"model: {meta.get('model_line', 'low-rank=' + str(meta.get('low_rank_kind')))}")
    headers, body = table(rows, unit)
    print(br.format_table(headers, body))
    note = (f"rank 0 shown, [max over ranks] where different; total = weights + grads + optimizer + act (alloc); "
            f"paper: {_GPU}, GB (a 7B model: compare ratios, not sizes).")
    print(note)
    print("\n".join(bp.verdict_lines(verdicts)))
    if out:
        written = br.write_report(out, rows, meta, TITLE, headers, body, verdicts=verdicts, notes=[note])
        print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
