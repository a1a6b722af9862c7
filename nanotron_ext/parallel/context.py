"""Building nanotron's ParallelContext: validated first, named groups, bounded timeouts on every group.

The rank grid is nanotron's (see `ParallelContext._init_parallel_groups`):

    ranks = arange(world).reshape(expert=1, pp, dp, tp)

so TP neighbours are adjacent ranks, then DP, then PP. Each group is registered in the comm
ledger under its role name so bytes are reported per role.
"""
from __future__ import annotations

import datetime
import importlib
import os
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as torch_dist
from nanotron.parallel import ParallelContext

from nanotron_ext.parallel.comm import get_ledger


class ParallelismError(ValueError):
    """A parallel layout that cannot run; raised before any process group exists."""


def validate_parallelism(
    world_size: int,
    dp: int,
    tp: int,
    pp: int,
    *,
    num_layers: Optional[int] = None,
    hidden_size: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    ffn_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> None:
    """Check a layout against the world size and the model's shapes, naming the offending values."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise ParallelismError(f"parallelism.{name} must be >= 1, got {value}")
    if dp * tp * pp != world_size:
        raise ParallelismError(
            f"world size {world_size} != parallelism.dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp}"
        )
    if num_layers is not None and num_layers < pp:
        raise ParallelismError(f"model.num_layers={num_layers} is fewer than pipeline stages parallelism.pp={pp}")
    for key, value in (
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("ffn_size", ffn_size),
        ("vocab_size", vocab_size),
    ):
        if value is not None and value % tp != 0:
            raise ParallelismError(f"model.{key}={value} is not divisible by parallelism.tp={tp}")


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


def build_parallel_context(
    dp: int, tp: int, pp: int, backend: Optional[str] = None, timeout_s: float = 120.0
) -> ParallelContext:
    """Initialise torch.distributed (if needed) and nanotron's ParallelContext for a dp x tp x pp grid.

    backend: "gloo", "nccl" or None (nccl with CUDA, gloo without). timeout_s bounds every collective of
    every group (default, world, tp, dp, pp, mp), so a dead or frozen peer turns into an error instead of a hang.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_parallelism(world_size, dp, tp, pp)
    # torch._dynamo (imported by the first optimizer, torch.optim's @_disable_dynamo) keeps one process group
    # alive past destroy_process_group when it is imported after the groups exist: its gloo threads then run
    # into interpreter exit (a rare "terminate called without an active exception"). Import it first.
    importlib.import_module("torch._dynamo")
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
