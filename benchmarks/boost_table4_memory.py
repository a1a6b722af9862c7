"""BOOST Table 4: per-TP-rank memory breakdown (weights, gradients, optimizer states, activations).

    python benchmarks/boost_table4_memory.py [options] [-- torchrun options]   (default 2 CPU ranks, TP=2)

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
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boost_common as bc  # noqa: E402

STRATEGIES = ("megatron", "vanilla", "btp")
NAMES = {"megatron": "megatron (full rank)", "vanilla": "vanilla low-rank TP", "btp": "BOOST btp"}
COLUMNS = ("weights", "grads", "optimizer", "act_alloc", "act_saved", "cuda_peak_act")


def measure(cfg: Any, ctx: Any) -> Dict[str, Optional[int]]:
    """This rank's memory breakdown for the model `cfg` describes."""
    import torch

    from nanotron_ext.train.pipeline_step import forward_backward

    if ctx.pp_pg.size() != 1:
        raise ValueError("boost_table4_memory measures one stage holding the whole model: use pp = 1")
    t = bc.build_trainee(cfg, ctx)
    mb = bc.random_micro_batches(cfg, 1)[0]
    ids, labels = mb["input_ids"].to(ctx.device), mb["label_ids"].to(ctx.device)
    out: Dict[str, Optional[int]] = {}
    # one full iteration first: gradients and optimizer state exist afterwards, as in training
    with bc.autocast_for(cfg, ctx.device):
        forward_backward(t.model, t.engine, [mb], ctx)
    out["grads"] = bc.persistent_bytes(t.model, None)["grads"]
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    persistent = bc.persistent_bytes(t.model, t.optimizer)
    out["weights"], out["optimizer"] = persistent["weights"], persistent["optimizer"]
    bc.sync_all(ctx.device)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        bc.reset_peak(ctx.device)
    with bc.autocast_for(cfg, ctx.device):
        loss, act = bc.activation_bytes(t.model, lambda: t.model(input_ids=ids, label_ids=labels)["loss"], ctx.device)
    loss.backward()
    out["act_alloc"], out["act_saved"] = act["allocator"], act["saved"]
    out["cuda_peak_act"] = int(torch.cuda.max_memory_allocated() - base) if cuda else None
    t.optimizer.zero_grad(set_to_none=True)
    bc.release(t)
    return out


def worker(args: argparse.Namespace) -> None:
    names, cfgs, ctx = bc.worker_configs(args)
    rows = []
    for name, cfg in zip(names, cfgs):
        per_rank = bc.gather_to_main(measure(cfg, ctx))
        rows.append({"name": name, "rank0": per_rank[0],
                     "max_over_ranks": {k: (None if per_rank[0][k] is None else max(r[k] for r in per_rank))
                                        for k in COLUMNS}})
    bc.write_worker_result(args.result_file, {"rows": rows, "meta": bc.common_worker_meta(cfgs[0], ctx)})


def table_rows(rows: Sequence[Dict[str, Any]], unit: str) -> List[List[Any]]:
    """Rank-0 numbers (max over ranks in brackets where it differs); total = persistent + act (alloc)."""
    out = []
    for r in rows:
        r0, mx = r["rank0"], r["max_over_ranks"]
        cells = []
        for k in COLUMNS:
            v = bc.fmt_bytes(r0[k], unit) if r0[k] is not None else "-"
            if r0[k] is not None and mx[k] != r0[k]:
                v += f" [{bc.fmt_bytes(mx[k], unit)}]"
            cells.append(v)
        total = sum(r0[k] for k in ("weights", "grads", "optimizer", "act_alloc"))
        out.append([r["name"], *cells, bc.fmt_bytes(total, unit)])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, torchrun_args = bc.split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    bc.add_run_args(p, iters=1, warmup=0)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="rows (default: all three)")
    p.add_argument("--unit", choices=["KiB", "MiB", "GiB"], default="MiB")
    args = p.parse_args(own)
    if args.worker:
        worker(args)
        return 0
    if args.config_file is None and args.micro_batch is None:
        args.micro_batch = 4  # the paper's Table 4 batch
    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = bc.require_strategies(wanted)
    shared = bc.shape_overrides(args) + list(args.overrides)
    kind = bc.base_low_rank_kind(args.config_file, shared, args.low_rank_kind)
    cfgs = {NAMES[s]: bc.resolve_config(args.config_file, shared + bc.strategy_overrides(s, kind)) for s in strategies}
    result = bc.run_job(__file__, cfgs, [], torchrun_args, args.log_dir, args.timeout, args.verbose)
    meta = result["meta"]
    rows = result["rows"]
    any_cfg = next(iter(cfgs.values()))
    print(f"BOOST Table 4 (memory per TP rank) on {meta['machine']}, tp={meta['tp']}, {meta['date']}")
    print(f"model: d={any_cfg.model.hidden_size} d_ff={any_cfg.model.ffn_size} layers={any_cfg.model.num_layers} "
          f"r={any_cfg.model.rank} low-rank={kind}; micro-batch {any_cfg.tokens.micro_batch_size} x seq "
          f"{any_cfg.tokens.sequence_length}; dtype {any_cfg.model.dtype}; AdamW")
    headers = ["strategy", f"weights {args.unit}", f"grads {args.unit}", f"optimizer {args.unit}",
               f"act (alloc) {args.unit}", f"act (saved) {args.unit}", f"cuda peak act {args.unit}",
               f"total {args.unit}"]
    print(bc.format_table(headers, table_rows(rows, args.unit)))
    for s in wanted:
        if s not in strategies:
            print(f"{NAMES[s]}: not available (tp_strategy not registered)")
    print("rank 0 shown, [max over ranks] where different; total = weights + grads + optimizer + act (alloc).")
    if args.out:
        print(f"wrote {bc.write_rows(args.out, rows, {**meta, 'low_rank_kind': kind})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
