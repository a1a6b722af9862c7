"""Building nanotron's ParallelContext: validated first, named groups, bounded timeouts on every group.

The rank grid is nanotron's (see `ParallelContext._init_parallel_groups`):

    ranks = arange(world).reshape(expert=1, pp, dp, tp)

so TP neighbours are adjacent ranks, then DP, then PP. Each group is registered in the comm
ledger under its role name so bytes are reported per role.

Two public ways in: `context_for(cfg)` (a job's groups for a run config: the trainer, the reproduction
workers under torchrun) and `standalone_context()` (scripts and tools that build a model in this one
process: parameter counts, analyses, the simulated replicas). `build_parallel_context` is what both use.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch
import torch.distributed as torch_dist
from nanotron.parallel import ParallelContext

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.layout import validate_parallelism


class TimedParallelContext(ParallelContext):
    """nanotron's ParallelContext whose every group (world, tp, dp, pp, mp, expert) waits at most `timeout`.

    nanotron creates its groups with `dist.new_group(ranks=...)` and no timeout, so they get torch's default
    (30 minutes for gloo): with one frozen rank, every collective outside the default group hung that long
    whatever `general.collective_timeout_s` said. nanotron's own world group (made in its __init__, before
    `_init_parallel_groups`) is replaced by a timed one and left unused.
    """

    def __init__(self, *args: Any, timeout: datetime.timedelta, **kwargs: Any) -> None:
        self.timeout = timeout
        super().__init__(*args, **kwargs)

    def _init_parallel_groups(self) -> None:
        self.world_pg = torch_dist.new_group(ranks=list(range(int(os.environ["WORLD_SIZE"]))), timeout=self.timeout)
        super()._init_parallel_groups()

    def create_new_group(self, all_groups_ranks: np.ndarray) -> torch_dist.ProcessGroup:
        # nanotron's loop (every rank creates every group, in the same order), with the timeout
        torch_dist.barrier()
        rank = int(os.environ["RANK"])
        mine = None
        for group_ranks in all_groups_ranks:
            key = tuple(sorted(int(r) for r in group_ranks))
            if key not in self.world_ranks_to_pg:
                self.world_ranks_to_pg[key] = torch_dist.new_group(ranks=list(key), timeout=self.timeout)
            if rank in key:
                mine = self.world_ranks_to_pg[key]
        torch_dist.barrier()
        return mine


def _dynamo_first() -> None:
    """torch._dynamo (imported by the first optimizer, torch.optim's @_disable_dynamo, and by building a model)
    keeps one process group alive past destroy_process_group when it is imported after the groups exist: its gloo
    threads then run into interpreter exit (a rare "terminate called without an active exception"), or outlive a
    world of one opened and destroyed inside a longer process. Import it before any group."""
    importlib.import_module("torch._dynamo")


def build_parallel_context(
    dp: int, tp: int, pp: int, backend: Optional[str] = None, timeout_s: float = 120.0
) -> ParallelContext:
    """Initialise torch.distributed (if needed) and nanotron's ParallelContext for a dp x tp x pp grid.

    backend: "gloo", "nccl" or None (nccl with CUDA, gloo without). timeout_s bounds every collective of
    every group (default, world, tp, dp, pp, mp), so a dead or frozen peer turns into an error instead of a hang.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_parallelism(world_size, dp, tp, pp)
    _dynamo_first()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch_dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch_dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    ctx = TimedParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                               backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    ledger = get_ledger()
    for name in ("tp", "pp", "dp", "mp", "world"):
        ledger.name_group(getattr(ctx, f"{name}_pg"), name)
    ledger.name_group(torch_dist.distributed_c10d._get_default_group(), "world")
    return ctx


def context_for(cfg: Any, world_size: Optional[int] = None) -> ParallelContext:
    """The process groups of a job for run config `cfg` (a nanotron_ext.config.Config; typed Any: parallel/
    does not import config/): the layout is validated against the world first (a ConfigError naming the
    keys, before any group exists), then parallelism.dp x tp x pp with general.backend and
    general.collective_timeout_s."""
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world_size=world)
    p = cfg.parallelism
    backend = None if cfg.general.backend == "auto" else cfg.general.backend
    return build_parallel_context(p.dp, p.tp, p.pp, backend=backend, timeout_s=cfg.general.collective_timeout_s)


def init_portless(backend: str, rank: int = 0, world_size: int = 1, store_file: Optional[str] = None,
                  timeout_s: float = 120.0) -> None:
    """The default process group of processes on this machine, with a rendezvous that takes no TCP port: an
    in-process store for a world of one, a FileStore at `store_file` for several. (A free port picked, released
    and bound again can be taken by another job in between: EADDRINUSE under a loaded test suite.)"""
    _dynamo_first()
    store = torch_dist.HashStore() if world_size == 1 else torch_dist.FileStore(store_file, world_size)
    torch_dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                  timeout=datetime.timedelta(seconds=timeout_s))


def standalone_context(tp: int = 1, backend: Optional[str] = "gloo") -> ParallelContext:
    """dp = pp = 1 with `tp` TP ranks over this job's processes (`backend` None: NCCL with CUDA, else gloo).
    In a lone process (no torchrun, no process group yet) that is a one-rank group (init_portless), and the
    rank variables nanotron reads are not left behind (a child process would inherit them). A process asks
    again and again (parameter counts, the WAN meter's closed forms, each dry-run preset): it gets the same
    context while the default group it was built on lives, since every new context's gloo groups keep their
    threads (three per group) until the process ends."""
    # the variables and the default group are the process's: threads building contexts at once (the WAN meter's
    # closed forms with --jobs > 1) once saw another thread's lone-rank RANK, then its WORLD_SIZE removed under them
    with _LONE:
        built = _BUILT.get((tp, backend))
        if built is not None and torch_dist.is_initialized() and built[0] is torch_dist.group.WORLD:
            return built[1]
        if "RANK" in os.environ:  # a launched rank
            ctx = build_parallel_context(1, tp, 1, backend=backend)
        else:
            with lone_rank_env():
                if not torch_dist.is_initialized():
                    init_portless(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
                ctx = build_parallel_context(1, tp, 1, backend=backend)
        if torch_dist.is_initialized():
            _BUILT[(tp, backend)] = (torch_dist.group.WORLD, ctx)
        return ctx


_LONE = threading.Lock()  # one standalone_context at a time per process
# (tp, backend) -> (the default group it was built on, the context): a group destroyed and made again is a new one
_BUILT: Dict[Tuple[int, Optional[str]], Tuple[Any, ParallelContext]] = {}


def release_process_groups() -> None:
    """Destroy every process group so that its gloo threads (two per group, plus its TCP loop) end now, not at
    interpreter exit: nanotron's cached group lookups (functools caches keyed by, and holding, the groups) are
    cleared and the groups nothing else holds are collected first, since a group still referenced keeps its
    threads past destroy_process_group(). The caller drops its own references (model, context) before; the
    contexts standalone_context keeps are dropped here."""
    import gc

    from nanotron import distributed as nanotron_dist

    with _LONE:
        _BUILT.clear()
    nanotron_dist.get_rank.cache_clear()
    nanotron_dist.get_global_rank.cache_clear()
    gc.collect()
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def lone_rank_env() -> Iterator[None]:
    """RANK, WORLD_SIZE and LOCAL_RANK of a lone process (nanotron reads them), restored on the way out."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    # A second standalone context in the same process finds the group from the first already made (nanotron
    # reads WORLD_SIZE and LOCAL_RANK even then); its rank and size stand in for the variables.
    rank, world = (torch_dist.get_rank(), torch_dist.get_world_size()) if torch_dist.is_initialized() else (0, 1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
