"""failures.describe_collective_failure names the peer of a failed call even where the error surfaces away from the
torch.distributed call: from nanotron's P2P (a Work's wait() in send_tensors / recv_tensors) or from nowhere it can
read (the default group's other ranks). A 2-host run's line once read "a collective on the world group failed"
without the host to look at. Run in a subprocess: torch's fake process group (world 2, rank 0, one rank per node)
is process-wide state."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from nanotron_ext.train.failures import describe_collective_failure

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
pg = dist.new_group([0, 1])
name = lambda g: "world" if g is None else "pp"
RESET = "Read error [10.77.0.2]:5347: Connection reset by peer."

def waited():  # a Work's wait() in our own code: no frame to read the group or the peer from
    raise RuntimeError(RESET)

P2P = """
class P2P:
    def __init__(self, pg):
        self.pg = pg
    def recv_tensors(self, num_tensors, from_rank, tag=0):
        raise RuntimeError(RESET)
"""
space = {"RESET": RESET}
exec(compile(P2P, "/site-packages/nanotron/parallel/pipeline_parallel/p2p.py", "exec"), space)
lines = []
for call in (waited, lambda: space["P2P"](pg).recv_tensors(1, from_rank=1)):
    try:
        call()
    except RuntimeError as exc:
        lines.append(describe_collective_failure(exc, name, 10.0))
print(json.dumps(lines))
'''


def test_the_peer_is_named_from_nanotron_p2p_or_the_default_group() -> None:
    env = {**os.environ, "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    waited, p2p = json.loads(done.stdout.strip().splitlines()[-1])
    assert waited.startswith("error: rank 0 (node 0): a collective on the world group with rank 1 (node 1) failed "
                             "because a peer rank went away"), waited
    assert p2p.startswith("error: rank 0 (node 0): recv_tensors on the pp group with rank 1 (node 1) failed"), p2p
