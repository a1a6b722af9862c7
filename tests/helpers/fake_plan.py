"""A stand-in for nanotron_ext.plan.run._worker (tests/test_plan_schedule.py): it plans nothing and reports which
stand-in processes ran beside it. Its `overrides` (what the planner hands every worker) carry `dir=PATH` (a folder
where each running process keeps a file named after its rank) and `expect=N`: a process waits up to WAIT_S for N
processes to run at once, then reports the most it saw and which ranks they were. Counting, not timing: on a loaded
machine a process may start late, and it still meets the ones running."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

WAIT_S = 4.0


def worker(config_file: str, overrides: Sequence[str], rank: int, port: int, out: Any, outer: bool = True,
           device: str = "cuda") -> None:
    opts = dict(o.split("=", 1) for o in overrides if "=" in o)
    folder, expect = Path(opts["dir"]), int(opts["expect"])
    mine = folder / str(rank)
    mine.touch()
    most, beside = 0, []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        running = sorted(int(p.name) for p in folder.iterdir())
        if len(running) > most:
            most, beside = len(running), running
        if most >= expect:
            break
        time.sleep(0.02)
    time.sleep(0.2)  # long enough for the others of its column to see it
    mine.unlink()
    out.put((rank, "ok", {"rank": rank, "dp_rank": None, "pid": os.getpid(), "most": most, "beside": beside}))
