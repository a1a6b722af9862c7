"""A stand-in for nanotron_ext.plan.run._worker (tests/test_plan_schedule.py): it plans nothing, holds its process for
a moment and reports when it ran, so the planner's scheduling can be timed without building any model."""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

HOLD_S = 1.5


def worker(config_file: str, overrides: Sequence[str], rank: int, port: int, out: Any, outer: bool = True) -> None:
    start = time.time()
    time.sleep(HOLD_S)
    out.put((rank, "ok", {"rank": rank, "dp_rank": None, "pid": os.getpid(), "start": start, "end": time.time()}))
