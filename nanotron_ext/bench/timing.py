"""Timing: warm-up and spread, speedups, per-iteration timing between barriers, interleaved rounds.

Rules every script follows: time.perf_counter around the measured region with a barrier on every
rank before and after (and torch.cuda.synchronize on GPU), so one number covers the slowest rank;
per-iteration times are max-reduced over ranks; the first `warmup` iterations are dropped and the
rest summarised (mean, sample std, median, min, max, n). Bytes and calls of collectives come from
the comm ledger (patch 0007 hooks) per group role ("tp", "dp", "pp"). Time inside collectives comes
from torch.profiler in separate iterations (interleaved's comm_split), never from the timed ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Summary:
    """Post-warm-up statistics of per-iteration times (seconds)."""

    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); 0 for a single sample
    median: float
    min: float
    max: float

    @property
    def sem(self) -> float:
        """Standard error of the mean."""
        return self.std / math.sqrt(self.n) if self.n > 0 else float("nan")


def summarize(times: Sequence[float], warmup: int) -> Summary:
    """Drop the first `warmup` iterations and summarise the rest."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    kept = list(times)[warmup:]
    if not kept:
        raise ValueError(f"no iterations left after dropping {warmup} warm-up iterations of {len(times)}")
    std = statistics.stdev(kept) if len(kept) > 1 else 0.0
    return Summary(n=len(kept), mean=statistics.fmean(kept), std=std, median=statistics.median(kept),
                   min=min(kept), max=max(kept))


def pooled_summary(rounds: Sequence[Sequence[float]], warmup: int) -> Summary:
    """Drop `warmup` iterations of EACH round (each is a fresh launch), summarise what is left."""
    kept: List[float] = []
    for times in rounds:
        kept += list(times)[warmup:]
    return summarize(kept, 0)


def ratio(num: Tuple[float, float], den: Tuple[float, float]) -> Tuple[float, float]:
    """(num / den, its standard error) of two independent (mean, standard error) pairs, by first-order
    error propagation."""
    r = num[0] / den[0]
    return r, math.sqrt(num[1] ** 2 + (r * den[1]) ** 2) / abs(den[0])  # = |r| sqrt(rel^2 + rel^2); num may be 0


def speedup(reference: Summary, candidate: Summary) -> Tuple[float, float]:
    """(reference mean / candidate mean, its standard error by first-order error propagation of the
    two means' standard errors); > 1 means the candidate is faster."""
    return ratio((reference.mean, reference.sem), (candidate.mean, candidate.sem))


def difference(a: Summary, b: Summary) -> Tuple[float, float]:
    """(a mean - b mean, its standard error) for means of separate (independent) iterations."""
    return a.mean - b.mean, math.sqrt(a.sem ** 2 + b.sem ** 2)


def rotated(names: Sequence[str], round_index: int) -> List[str]:
    """`names` rotated by the round index, so that no variant always runs first across rounds."""
    names = list(names)
    shift = round_index % max(1, len(names))
    return names[shift:] + names[:shift]


# ------------------------------------------------------------------------------------------------
# under torch.distributed
# ------------------------------------------------------------------------------------------------
def sync_all(device: Any) -> None:
    """Finish queued GPU work and line up every rank (torch.distributed directly: not in the ledger)."""
    # torch on the worker side only: orchestrators run without it
    import torch
    import torch.distributed as td

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
    if td.is_initialized() and td.get_world_size() > 1:
        td.barrier()


def _reduce(values: Sequence[float], mean: bool) -> List[float]:
    # torch on the worker side only: orchestrators run without it
    import torch
    import torch.distributed as td

    t = torch.tensor(list(values), dtype=torch.float64)
    if td.is_initialized() and td.get_world_size() > 1:
        if td.get_backend() == "nccl":
            t = t.cuda()
        td.all_reduce(t, op=td.ReduceOp.SUM if mean else td.ReduceOp.MAX)
        if mean:
            t /= td.get_world_size()
    return [float(v) for v in t.cpu().tolist()]


def max_over_ranks(values: Sequence[float]) -> List[float]:
    """Element-wise max over all ranks (each iteration is as slow as its slowest rank)."""
    return _reduce(values, mean=False)


def mean_over_ranks(values: Sequence[float]) -> List[float]:
    """Element-wise mean over all ranks."""
    return _reduce(values, mean=True)


@contextlib.contextmanager
def profiler_for(device: Any, memory: bool = False) -> Iterator[Any]:
    """torch.profiler over CPU (and CUDA on a GPU device)."""
    # torch on the worker side only: orchestrators run without it
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if getattr(device, "type", "cpu") == "cuda" else [])
    with profile(activities=acts, profile_memory=memory) as prof:
        yield prof


def comm_seconds(prof: Any) -> float:
    """Time spent in collectives in a torch.profiler trace: NCCL kernel time on GPU, the gloo
    collective events' wall time on CPU (both include waiting for the slowest peer)."""
    total_us = 0.0
    for e in prof.events():
        name = e.name.lower()
        if "nccl" in name and getattr(e, "device_time_total", 0):
            total_us += e.device_time_total if e.device_type.name == "CUDA" else 0.0
        elif name.startswith("gloo:"):
            total_us += e.cpu_time_total
    return total_us * 1e-6


@dataclasses.dataclass
class Timings:
    """Per-iteration measurements: wall seconds and process CPU seconds (each max over ranks),
    seconds inside collectives (mean over ranks, only when profiled) and this rank's ledger
    bytes/calls of one group per iteration (only with a ledger). `profiled_wall`: the wall seconds
    of the profiled iterations when those are separate from the timed ones (interleaved's comm_split)."""

    wall: List[float] = dataclasses.field(default_factory=list)
    cpu: List[float] = dataclasses.field(default_factory=list)
    comm: List[Dict[str, int]] = dataclasses.field(default_factory=list)
    comm_s: List[float] = dataclasses.field(default_factory=list)
    profiled_wall: List[float] = dataclasses.field(default_factory=list)

    def extend(self, other: "Timings") -> None:
        self.wall += other.wall
        self.cpu += other.cpu
        self.comm += other.comm
        self.comm_s += other.comm_s
        self.profiled_wall += other.profiled_wall


def timed(fn: Callable[[], Any], device: Any, iters: int, ledger: Any = None, profile: bool = False,
          group: str = "tp") -> Timings:
    """Run `fn` `iters` times between barriers. Wall time covers the slowest rank; CPU time
    (time.process_time of the call) is what this process computed, which other tenants' load on
    a shared machine barely changes (waiting in a collective sleeps). With a ledger, the bytes
    and calls of `group`'s collectives per iteration. With `profile`, each iteration runs under
    torch.profiler (started and stopped outside the timed window) and the time spent in
    collectives during that same iteration is recorded; the profiler slows what it watches (on one
    H200 a small block took 11.4 ms profiled, 6.2 ms not), so report totals from unprofiled
    iterations: interleaved(comm_split=True)."""
    wall, cpu, comm, comm_s = [], [], [], []
    for _ in range(iters):
        with (profiler_for(device) if profile else contextlib.nullcontext()) as prof:
            sync_all(device)
            if ledger is not None:
                ledger.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            c1 = time.process_time()
            if ledger is not None:  # read before the closing barrier (which the ledger does not count anyway)
                comm.append({"bytes": ledger.bytes(group=group), "calls": ledger.calls(group=group)})
            sync_all(device)
            wall.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
        if profile:
            comm_s.append(comm_seconds(prof))
    return Timings(max_over_ranks(wall), max_over_ranks(cpu), comm, mean_over_ranks(comm_s) if profile else [])


def interleaved(fns: Mapping[str, Callable[[], Any]], device: Any, iters: int, ledger: Any = None,
                comm_split: bool = False, group: str = "tp") -> Dict[str, Timings]:
    """Iteration i of every variant runs before iteration i+1 of any, so a load change on a shared
    machine hits every variant alike. Returns each variant's Timings (warm-up not dropped).

    With `comm_split`, each round then runs every variant once more under torch.profiler, and only
    those iterations give `comm_s` (and `profiled_wall`); wall, CPU time and ledger counts stay the
    unprofiled iterations', so totals are what runs without a profiler. Compute = mean total - mean
    comm of separate iterations (`difference`). The order rotates each round, so no variant always
    runs first after the profiler's teardown."""
    out = {name: Timings() for name in fns}
    for i in range(iters):
        order = rotated(list(fns), i) if comm_split else list(fns)
        for name in order:
            out[name].extend(timed(fns[name], device, 1, ledger=ledger, group=group))
        if comm_split:
            for name in order:
                prof = timed(fns[name], device, 1, profile=True, group=group)
                out[name].comm_s += prof.comm_s
                out[name].profiled_wall += prof.wall
    return out
