"""Which ranks a plan steps, and the processes that step them.

The rank grid is nanotron's (nanotron_ext.parallel.context): rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
A rank's pipeline neighbours must run beside it (their headers size its receives: nanotron_ext.plan.wire), so a
plan steps whole pipeline columns (the pp ranks of one DP replica and TP rank), one process each, at once, and
reports the ranks asked for; columns run side by side within the cores, and ranks of one role (pp rank, replica
config, TP rank) share one plan. By default: TP rank 0 of the first replica of each distinct replica config
(heterogeneous SparseLoCo's compressed and uncompressed replicas), every stage. TP ranks of a stage are alike
(the same shapes and calls; nanotron's row-parallel bias, absent here, would live on TP rank 0 alone).
"""
from __future__ import annotations

import copy
import json
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
            outer: bool = True, device: str = "cuda") -> None:
    # a rank's build and step print notes (a codec's choices, SparseLoCo's densities): the plan prints its own
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from nanotron_ext.config import load_config
        from nanotron_ext.plan.rank import plan_rank

        out.put((rank, "ok", plan_rank(load_config(config_file, list(overrides)), rank, "127.0.0.1", port, outer,
                                       device)))
    except BaseException:  # noqa: BLE001 - reported by the parent, which stops the other stages
        out.put((rank, "error", traceback.format_exc()))


def replica_roles(cfg: Any) -> List[int]:
    """For each DP replica, the first replica whose config it shares (its own index when it is the first): the
    DP sync may give replicas configs of their own (heterogeneous SparseLoCo), the rest of a layout is alike."""
    from nanotron_ext.config.loader import config_to_dict
    from nanotron_ext.registry import DP_SYNCS

    sync = DP_SYNCS.owner(cfg.parallelism.dp_sync)
    first: Dict[str, int] = {}
    out = []
    for dp_rank in range(cfg.parallelism.dp):
        rcfg = sync.replica_config(cfg, dp_rank)
        key = "" if rcfg is cfg else json.dumps(config_to_dict(rcfg), sort_keys=True, default=str)
        out.append(first.setdefault(key, dp_rank))
    return out


def stand_in(cfg: Any, rank: int, roles: Sequence[int]) -> int:
    """The rank planned for `rank`: the one of the same role (pp rank, replica config, TP rank) in the first
    replica of that config. Ranks of one role build the same model and make the same calls: one plan serves all."""
    pp_rank, dp_rank, tp_rank = coordinates(cfg, rank)
    return rank_of(cfg, pp_rank, roles[dp_rank], tp_rank)


def plan_ranks(config_file: str, overrides: Sequence[str], cfg: Any, ranks: Sequence[int],
               timeout_s: float = TIMEOUT_S, outer: bool = True, device: str = "cuda") -> List[Dict[str, Any]]:
    """The plans of `ranks`, in order (the reported iteration an outer step of the DP sync, or with `outer` False an
    inner one; memory as `device`, cuda or cpu, allocates it: nanotron_ext.plan.kernels). Each distinct role is
    planned once (`stand_in`) and its plan given to the other ranks of the role under their own rank numbers; the
    pipeline columns of the planned ranks run one process per rank, at most os.cpu_count() processes at a time (a
    column larger than that alone), with a progress bar over the columns (`plan --rank all` on a 4,096-rank layout
    started hundreds of processes at once and printed nothing for minutes). `timeout_s`: per column."""
    roles = replica_roles(cfg)
    planned_for = {r: stand_in(cfg, r, roles) for r in ranks}
    columns = sorted({tuple(column(cfg, s)) for s in planned_for.values()})
    plans = _run_columns(config_file, overrides, columns, timeout_s, outer, device)
    out = []
    for r in ranks:
        plan = copy.deepcopy(plans[planned_for[r]])
        plan.update(rank=r, dp_rank=coordinates(cfg, r)[1])
        out.append(plan)
    return out


def _run_columns(config_file: str, overrides: Sequence[str], columns: Sequence[Tuple[int, ...]], timeout_s: float,
                 outer: bool, device: str) -> Dict[int, Dict[str, Any]]:
    """Step the pipeline `columns` (a column's stages run together: each receive is sized by its neighbour's
    header), starting a column while the processes running stay within the cores; {rank: plan}."""
    import torch.distributed as torch_dist
    from tqdm import tqdm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the stages' headers
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    cores = max(1, os.cpu_count() or 1)
    pending = list(columns)
    running: Dict[Tuple[int, ...], Tuple[List[Any], float]] = {}
    results: Dict[int, Dict[str, Any]] = {}
    bar = tqdm(total=len(columns), desc="planning pipeline columns", unit="column", leave=False, file=sys.stderr,
               disable=None)  # None: no bar when stderr is not a terminal (logs, CI, refusals stay one line)
    try:
        while pending or running:
            while pending and (not running or sum(map(len, running)) + len(pending[0]) <= cores):
                col = pending.pop(0)
                procs = [ctx.Process(target=_worker, args=(config_file, list(overrides), r, port, out, outer, device),
                                     daemon=True) for r in col]
                for p in procs:
                    p.start()
                running[col] = (procs, time.monotonic())
            try:
                rank, status, payload = out.get(timeout=1.0)
            except queue.Empty:
                _check_running(running, out, timeout_s)
                continue
            if status == "error":
                raise RuntimeError(f"planning rank {rank} failed:\n{payload}")
            results[rank] = payload
            for col in [c for c in running if all(r in results for r in c)]:
                for p in running.pop(col)[0]:
                    p.join(timeout=10)
                bar.update(1)
    finally:
        bar.close()
        for procs, _ in running.values():
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
        del store
    return results


def _check_running(running: Dict[Tuple[int, ...], Tuple[List[Any], float]], out: Any, timeout_s: float) -> None:
    """A running column past `timeout_s`, or a process of one that died without reporting, ends the plan."""
    now = time.monotonic()
    for col, (procs, started) in running.items():
        if now - started > timeout_s:
            raise TimeoutError(f"planning the pipeline of ranks {list(col)} did not finish in {timeout_s:.0f} s")
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and out.empty():
            raise RuntimeError(f"a planned rank's process exited with code {dead[0].exitcode}")


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
