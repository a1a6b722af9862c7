"""Which ranks a plan steps, and the processes that step them.

The rank grid is nanotron's (nanotron_ext.parallel.context): rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
A rank's pipeline neighbours must run beside it (their headers size its receives: nanotron_ext.plan.wire), so a
plan steps whole pipeline columns (the pp ranks of one DP replica and TP rank), one process each, at once, and
reports the ranks asked for. By default: TP rank 0 of the first replica of each distinct replica config
(heterogeneous SparseLoCo's compressed and uncompressed replicas), every stage. TP ranks of a stage are alike
(the same shapes and calls; nanotron's row-parallel bias, absent here, would live on TP rank 0 alone).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

PRELOAD = ["torch", "torch.distributed", "nanotron", "nanotron_ext.train.replica", "nanotron_ext.plan.rank"]
TIMEOUT_S = 1800.0


def rank_of(cfg: Any, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
    p = cfg.parallelism
    return (pp_rank * p.dp + dp_rank) * p.tp + tp_rank


def coordinates(cfg: Any, rank: int) -> Tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    p = cfg.parallelism
    return rank // (p.dp * p.tp), rank // p.tp % p.dp, rank % p.tp


def column(cfg: Any, rank: int) -> List[int]:
    """The ranks of `rank`'s pipeline (same DP replica and TP rank), first stage first."""
    _, dp_rank, tp_rank = coordinates(cfg, rank)
    return [rank_of(cfg, s, dp_rank, tp_rank) for s in range(cfg.parallelism.pp)]


def default_ranks(cfg: Any) -> List[int]:
    """Every stage of TP rank 0 of the first DP replica of each distinct replica config."""
    from nanotron_ext.config.tiers import replica_codecs

    firsts = sorted(replicas[0] for replicas, _ in replica_codecs(cfg).values())
    return [r for dp_rank in firsts for r in column(cfg, rank_of(cfg, 0, dp_rank, 0))]


def _worker(config_file: str, overrides: Sequence[str], rank: int, port: int, out: "mp.Queue",
            outer: bool = True) -> None:
    # a rank's build and step print notes (a codec's choices, SparseLoCo's densities): the plan prints its own
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from nanotron_ext.config import load_config
        from nanotron_ext.plan.rank import plan_rank

        out.put((rank, "ok", plan_rank(load_config(config_file, list(overrides)), rank, "127.0.0.1", port, outer)))
    except BaseException:  # noqa: BLE001 - reported by the parent, which stops the other stages
        out.put((rank, "error", traceback.format_exc()))


def plan_ranks(config_file: str, overrides: Sequence[str], cfg: Any, ranks: Sequence[int],
               timeout_s: float = TIMEOUT_S, outer: bool = True) -> List[Dict[str, Any]]:
    """Step the pipeline columns of `ranks` (one process per rank) and return the plans of `ranks`, in order (the
    reported iteration an outer step of the DP sync, or with `outer` False an inner one)."""
    import torch.distributed as torch_dist

    run = sorted({r for rank in ranks for r in column(cfg, rank)})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the stages' headers
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(config_file, list(overrides), r, port, out, outer), daemon=True)
             for r in run]
    for p in procs:
        p.start()
    results: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(run):
            try:
                rank, status, payload = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the plan did not finish in {timeout_s:.0f} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and out.empty():
                    raise RuntimeError(f"a planned rank's process exited with code {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"planning rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
        del store
    return [results[r] for r in ranks]


def used_techniques(cfg: Any) -> List[Any]:
    """The techniques that provide a piece `cfg` names (its TP strategy, codecs, embedding, constraint, DP sync)."""
    from nanotron_ext.config.tiers import replica_codecs
    from nanotron_ext.registry import CODECS, DP_SYNCS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES

    m = cfg.model
    owners = [TP_STRATEGIES.owner(m.tp_strategy), EMBEDDINGS.owner(m.embedding.kind),
              OUTPUT_CONSTRAINTS.owner(m.output_constraint.kind), DP_SYNCS.owner(cfg.parallelism.dp_sync)]
    owners += [CODECS.owner(kind) for kind in replica_codecs(cfg)]
    return list({t.name: t for t in owners}.values())


def memory_switches(cfg: Any) -> List[Tuple[str, bool]]:
    """(key, value in cfg) of the boolean recompute switches (Technique.memory_switches) of the techniques in use."""
    out = []
    for technique in used_techniques(cfg):
        for key in technique.memory_switches:
            value: Any = cfg
            for part in key.split("."):
                value = getattr(value, part)
            out.append((key, bool(value)))
    return out


def flipped(switches: Sequence[Tuple[str, bool]]) -> Optional[List[str]]:
    """The --set overrides that flip every switch (None when there is none)."""
    return [f"{key}={str(not value).lower()}" for key, value in switches] or None
