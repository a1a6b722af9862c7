"""torchft smoke test on this machine: a lighthouse and 2 replica groups on localhost, each one process with
its own TCPStore, its Manager and torchft's reconfigurable ProcessGroupGloo; 3 quorums, one allreduce each.

    python scripts/torchft_smoke.py      # prints "torchft ok: ..." and exits 0, or the failure
"""
from __future__ import annotations

import multiprocessing as mp
import sys
from datetime import timedelta


def replica(i: int, lighthouse: str, out: "mp.Queue") -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    state = {"w": torch.zeros(3)}
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=lambda s: state.update(s),
                      state_dict=lambda: dict(state), replica_id=f"smoke_{i}", store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      use_async_quorum=False, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30))
    try:
        results = []
        for _ in range(3):
            manager.start_quorum()
            t = torch.full((3,), float(i + 1))
            manager.allreduce(t).wait()
            assert manager.should_commit()
            results.append(t.tolist())
        out.put((i, results, manager.current_step()))
    finally:
        manager.shutdown(wait=False)


def main() -> int:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(i, lighthouse.address(), out)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    lighthouse.shutdown()
    got = sorted(out.get(timeout=1) for _ in range(out.qsize() or 0)) if not out.empty() else []
    ok = len(got) == 2 and all(r == [[1.5, 1.5, 1.5]] * 3 and step == 3 for _, r, step in got)
    print(("torchft ok: " if ok else "torchft FAILED: ") + repr(got), "exit codes", [p.exitcode for p in procs])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
