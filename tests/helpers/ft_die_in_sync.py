"""A trainer worker that SIGKILLs itself inside its Nth outer sync (FT_DIE_IN_SYNC=N; the join before the first
step counts as the first), after the quorum that includes it, before its payload is gathered: a replica dying
mid-sync. Run as `python -m nanotron_ext.launch ... -m tests.helpers.ft_die_in_sync <nanotron_ext.train's args>`."""
from __future__ import annotations

import os
import signal
import sys

from nanotron_ext.sparseloco import fault


def main() -> int:
    die_in, seen = int(os.environ["FT_DIE_IN_SYNC"]), [0]
    gather = fault.FaultTolerantSparseLoCoSync._gather

    def gather_then_die(self: fault.FaultTolerantSparseLoCoSync, send: bool, error: list) -> object:
        seen[0] += 1
        if seen[0] == die_in:
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(self, send, error)

    fault.FaultTolerantSparseLoCoSync._gather = gather_then_die
    from nanotron_ext.train.__main__ import main as train

    return train()


if __name__ == "__main__":
    sys.exit(main())
