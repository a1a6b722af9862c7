"""Run a test body on several gloo/CPU processes on this machine.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, each with the usual
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), calls
`fn(*args)` in each and returns the per-rank return values (picklable). If any rank raises, the
others are terminated and the failing rank's traceback is re-raised here, so nothing hangs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable, List


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: "mp.Queue") -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1",
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        # torch tensors put on a multiprocessing queue travel as shared-memory handles that die with
        # this process; send plain bytes instead (pickle's own: a test's result is any object, and the parent
        # trusts its own children, which torch.load(weights_only=True) would not read)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        import torch.distributed as torch_dist

        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


# Ranks are forked from one server process that imported torch, nanotron and the package once (not spawned: each
# spawned rank spent ~3-5 s of CPU importing them again, over ~300 ranks per suite). The server has run no torch op
# and started no thread pool, so a fork of it is a clean process. Also preloaded: torch._dynamo, which every rank
# imports when it builds its groups (~1 CPU-s each), and pyplot, which a trainer's rank 0 imports to plot the loss.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "matplotlib.pyplot", "nanotron",
            "nanotron_ext.train.trainer", "tests.helpers.dist"]


def _context() -> "mp.context.BaseContext":
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _PortTaken(RuntimeError):
    pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240.0) -> List[Any]:
    """fn(*args) on `world_size` forked ranks; their results, in rank order. Once more on another port when rank 0's
    store found the free port taken meanwhile (another test's job bound it between free_port and the store)."""
    try:
        return _run_distributed(fn, world_size, args, timeout_s)
    except _PortTaken:
        return _run_distributed(fn, world_size, args, timeout_s)


def _run_distributed(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> List[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.time() + timeout_s
    try:
        while len(results) < world_size:
            if time.time() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout_s}s "
                                   f"({len(results)}/{world_size} ranks done)")
            try:
                rank, status, payload = queue.get(timeout=0.5)
            except Exception:  # queue.Empty
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        raise RuntimeError(f"rank process exited with code {dead[0].exitcode} without "
                                           "reporting") from None
                continue
            if status == "error":
                raise (_PortTaken if "EADDRINUSE" in payload else RuntimeError)(f"rank {rank} failed:\n{payload}")
            results[rank] = _load(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world_size)]


def _load(payload: bytes) -> Any:
    return pickle.loads(payload)
