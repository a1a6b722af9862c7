"""A rogue torchft peer (issue 33 row 14): a local process that joins the fault-tolerant job claiming a later step is
the peer torchft heals the replica from. It must not run code in the replica (torchft unpickled the healing state
without weights_only), and a state the run could not have produced is refused, naming the peer; the replica's
torchft services listen on the lighthouse's address only (they listened on all interfaces)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch

from tests.helpers.dist import free_port
from tests.helpers.net import listening

torchft = pytest.importorskip("torchft")  # the `ft` extra (in the dev extra that make setup installs)

CLAIMED_STEP = 100  # the rogue's step: ahead of the replica's 0, so torchft heals the replica from it


class _RunsCode:
    """Unpickling this calls os.mkdir(path): a stand-in for any code a peer could send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def _rogue_state(kind: str, shapes: List[torch.Size], marker: str) -> Dict[str, object]:
    right = [torch.zeros(s) for s in shapes]
    return {"runs_code": {"global": [_RunsCode(marker)], "momentum": [], "syncs": 1},
            "implausible_syncs": {"global": right, "momentum": [], "syncs": 10**6},
            "wrong_shape": {"global": [torch.zeros(3, 3)] + right[1:], "momentum": [], "syncs": 1},
            "step_mismatch": {"global": right, "momentum": [], "syncs": 1}}[kind]


def _rogue(lighthouse: str, state: Dict[str, object], served_step: Optional[int], stop: threading.Event) -> None:
    """A torchft replica group of its own (torchft's Manager and its default transport) claiming CLAIMED_STEP and
    serving `state`, joining every quorum until stopped. It never votes (should_commit would stop serving the state
    at once; an honest peer serves it until its gather with the healed replica is done)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - kept alive
    t = timedelta(seconds=10)
    m = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=lambda s: None, state_dict=lambda: state,
                min_replica_size=1, use_async_quorum=False, timeout=t, quorum_timeout=timedelta(seconds=30),
                connect_timeout=t, rank=0, world_size=1, replica_id="sparseloco_1", lighthouse_addr=lighthouse,
                store_addr="127.0.0.1", store_port=port)
    m.load_state_dict({"step": CLAIMED_STEP, "batches_committed": 0})
    if served_step is not None:  # the step it serves differs from the one it claimed
        m.state_dict = lambda: {"step": served_step, "batches_committed": 0}
    while not stop.is_set():
        try:
            m.start_quorum()
        except Exception:  # noqa: BLE001 - the replica gave up: nothing left to join
            break


def _scenarios(kinds: List[str], out: str, marker: str) -> None:
    """Spawned: one replica (dp = 1, a 48 x 32 linear) per kind of rogue, each with a lighthouse of its own; writes
    what happened to `out`."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from torchft.coordination import LighthouseServer

    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.config import FaultToleranceConfig, SparseLoCoConfig
    from nanotron_ext.sparseloco.fault import FaultTolerantSparseLoCoSync

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 32)
    before = [p.detach().clone() for p in model.parameters()]
    results: Dict[str, object] = {}
    for kind in kinds:
        lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
        url = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"
        ft = FaultToleranceConfig(enabled=True, lighthouse=url, replica=0, replicas=2, min_replicas=2, timeout_s=10,
                                  quorum_timeout_s=30, max_retries=1)
        cfg = SimpleNamespace(sparseloco=SparseLoCoConfig(inner_steps=3, chunk=64, topk=8, index_bits=6,
                                                          fault_tolerance=ft), tokens=SimpleNamespace(train_steps=30))
        sockets = set(listening(pid=os.getpid()))
        sync = FaultTolerantSparseLoCoSync(model, ctx, cfg)
        results.setdefault("new_listening", sorted(set(listening(pid=os.getpid())) - sockets))
        stop = threading.Event()
        state = _rogue_state(kind, [p.shape for p in model.parameters()], marker)
        rogue = threading.Thread(target=_rogue, args=(url, state, 5 if kind == "step_mismatch" else None, stop),
                                 daemon=True)
        rogue.start()
        try:
            sync.start()
            error = None
        except Exception as e:  # noqa: BLE001 - what the replica ended with is the result
            error = f"{type(e).__name__}: {e}"
        stop.set()
        results[kind] = {"error": error, "ran_code": os.path.exists(marker),
                         "weights_kept": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
        sync.close()
    Path(out).write_text(json.dumps(results))
    os._exit(0)  # torchft's server threads (and the rogue's blocked quorum): do not wait for interpreter teardown


REFUSALS = {  # rogue -> what the refusal says after "refused to heal from the peer at http://127.0.0.1:PORT/..."
    "runs_code": "its state is not only tensors, numbers and containers (read with weights_only: "
                 "nothing in it was run)",
    "implausible_syncs": f"(quorum step {CLAIMED_STEP}): its outer sync count 1000000 is not in [0, step "
                         f"{CLAIMED_STEP} and this run's 10 outer syncs]",
    "wrong_shape": f"(quorum step {CLAIMED_STEP}): tensor 0 is (3, 3) torch.float32, this replica's is (32, 48) "
                   "torch.float32",
    "step_mismatch": f"(quorum step {CLAIMED_STEP}): it carries step 5, the quorum announced {CLAIMED_STEP}",
}


@pytest.mark.timeout(240)
def test_a_rogue_peer_claiming_a_later_step_runs_no_code_and_is_refused(tmp_path: Path) -> None:
    """Each rogue claims step 100 (the replica is at 0): torchft heals the replica from it. Its state holds an object
    whose unpickling runs code (os.mkdir of a marker folder), or tensors this run could not have produced (an outer
    sync count past the run's 30 / 3 = 10, a wrong shape) or a step other than the one it claimed. Every one is
    refused in both attempts (max_retries=1), the replica ends with one error naming the peer, its weights are
    untouched, and the marker folder never appears. The replica's torchft services (Manager, recovery server)
    listen on 127.0.0.1, the lighthouse's address, not on all interfaces."""
    out, marker = tmp_path / "results.json", tmp_path / "the_peer_ran_code_here"
    p = mp.get_context("spawn").Process(target=_scenarios, args=(list(REFUSALS), str(out), str(marker)))
    p.start()
    p.join(200)
    if p.is_alive():
        p.kill()
    assert out.exists(), f"the scenarios did not finish (exit code {p.exitcode})"
    results = json.loads(out.read_text())
    assert not marker.exists(), "the replica ran code a peer sent"
    new = results.pop("new_listening")
    assert len(new) == 2 and all(a.startswith("127.0.0.1:") for a in new), new
    for kind, reason in REFUSALS.items():
        r = results[kind]
        assert r["weights_kept"] and not r["ran_code"], (kind, r)
        error = r["error"] or ""
        assert error.startswith("TrainingError: sparseloco.fault_tolerance: outer sync 1 failed 2 times "
                                "(sparseloco.fault_tolerance.max_retries=1); last error: refused to heal from the "
                                "peer at http://"), (kind, error)
        assert reason in error and "\n" not in error, (kind, error)


def test_ft_launch_serves_the_lighthouse_on_the_configured_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ft_launch's lighthouse listens on sparseloco.fault_tolerance.lighthouse's address (it listened on all
    interfaces, [::]); read from the kernel's socket table while the launcher would start its replicas."""
    from nanotron_ext.sparseloco import ft_launch

    port, seen = free_port(), []

    def replica(cmd: List[str], **kw: object) -> SimpleNamespace:  # instead of a replica job: look, and finish
        seen.append(listening(port))
        return SimpleNamespace(pid=-1, poll=lambda: 0)

    monkeypatch.setattr(ft_launch.subprocess, "Popen", replica)
    example = Path(__file__).parent.parent / "examples" / "config_tiny_sparseloco_ft.yaml"
    assert ft_launch.main(["--config-file", str(example), "--set",
                           f"sparseloco.fault_tolerance.lighthouse=http://127.0.0.1:{port}"]) == 0
    assert seen == [[f"127.0.0.1:{port}"]] * 2, seen
