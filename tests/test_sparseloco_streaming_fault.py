"""The streaming outer sync on torchft (nanotron_ext.sparseloco.fault_streaming) against stand-ins for torchft's
Manager and process group, in one process, so the orderings a real run reaches only by chance happen every time:

- two replicas, no fault: every replica's weights after every step equal the float64 simulation of Streaming DiLoCo
  with SparseLoCo's compression in tests/test_sparseloco_streaming.py (the same seeded moves and equations);
- a peer dies while the sync is in flight: the vote at the arrival fails, the sync is retried at once with the
  payload sent at the start (not one re-encoded from the weights trained since), and the result equals the clean
  run's bit for bit; max_retries failures stop the run with one error;
- a replica healed in that retry takes the peer's global weights and outer state, sends nothing, and after the
  commit holds global_new (that sync's outer step from the peer's payload) with zero error feedback;
- a checkpoint taken with the sync in flight and resumed gathers the saved payload again at the arrival and ends
  bit for bit as the run that went on; healed at its join instead, the replica drops it.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch

from tests.test_sparseloco_streaming import SPARSE, STEPS, _assert_matches, _cfg, _inner_step, _noise, _reference

pytest.importorskip("torchft")  # fault.py imports it at module level (the `ft` extra)


class _Manager:
    """torchft.Manager's part the sync uses; `heal(sync)` runs in the quorums it names (1-based)."""

    _group_rank = 0

    def __init__(self, heal_in: Optional[Dict[int, object]] = None) -> None:
        self.err: Optional[Exception] = None
        self.quorums, self.heal_in = 0, heal_in or {}
        self.sync = None

    def start_quorum(self) -> None:
        self.err, self.quorums = None, self.quorums + 1
        if self.quorums in self.heal_in:
            self.sync._load_peer_state(self.heal_in[self.quorums])

    def errored(self) -> Optional[Exception]:
        return self.err

    def report_error(self, e: Exception) -> None:
        self.err = e

    def should_commit(self) -> bool:
        return self.err is None

    def state_dict(self) -> Dict[str, int]:
        return {"step": 0}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        pass


class _Board:
    """A two-replica all_gather in one process: round k of every replica meets round k of the other; its work is
    done when waited on (both have issued by then). `dies`: rounds whose wait fails (a peer died in flight)."""

    def __init__(self, dies: int = 0, peer: Optional[torch.Tensor] = None) -> None:
        self.inputs: Dict[int, Dict[int, torch.Tensor]] = {}
        self.dies, self.peer = dies, peer  # peer: a fixed payload from a replica outside this process

    def group(self, replica: int) -> object:
        board, rounds = self, [0]

        def allgather(outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: object) -> object:
            k = rounds[0]
            rounds[0] += 1
            board.inputs.setdefault(k, {})[replica] = inputs[0].clone()
            if board.peer is not None:
                board.inputs[k][1 - replica] = board.peer

            def wait() -> None:
                if board.dies:
                    board.dies -= 1
                    outputs[0][0].fill_(7)  # half-written buffers: must not be used
                    raise RuntimeError("Connection closed by peer")
                for r, out in enumerate(outputs[0]):
                    out.copy_(board.inputs[k][r])
            return SimpleNamespace(wait=wait)

        return SimpleNamespace(size=lambda: 2, allgather=allgather)


def _stub_sync(replica: int, model: torch.nn.Module, board: _Board, manager: _Manager, max_retries: int = 3):
    from nanotron_ext.parallel.comm import CommLedger
    from nanotron_ext.sparseloco.config import FaultToleranceConfig
    from nanotron_ext.sparseloco.fault_streaming import StreamingFaultTolerantSparseLoCoSync
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter

    cfg = _cfg(SPARSE, 2)
    cfg.fault_tolerance = FaultToleranceConfig(enabled=True, replica=replica, replicas=2, max_retries=max_retries)
    sync = object.__new__(StreamingFaultTolerantSparseLoCoSync)  # the sync's own state, torchft replaced by stubs
    sync.scfg, sync.ft, sync.hooks, sync.ledger, sync.attempts = cfg, cfg.fault_tolerance, [], CommLedger(), []
    sync.params = list(model.parameters())
    sync.names = [n for n, _ in model.named_parameters()]
    sync.outer = SparseLoCoOuter(sync.params, cfg)
    sync.error = sync.outer.new_error()
    sync.pg, sync.manager = board.group(replica), manager
    manager.sync = sync
    sync.lighthouse = SimpleNamespace(wait=lambda: None, during=lambda: __import__("contextlib").nullcontext())
    sync.is_main, sync.healed, sync.hetero, sync._fixed_from_peer = False, False, None, False
    sync.delay, sync.alpha, sync.flight = cfg.streaming.delay, cfg.streaming.alpha, None
    return sync


def _models() -> List[torch.nn.Module]:
    models = []
    for r in range(2):
        torch.manual_seed(r)
        models.append(torch.nn.Linear(128, 64))
    with torch.no_grad():  # torchft's step-0 heal: every replica starts from replica 0's weights
        for p, p0 in zip(models[1].parameters(), models[0].parameters()):
            p.copy_(p0)
    return models


def _run() -> List[object]:
    """Two replicas, STEPS seeded inner steps; returns per step, per replica, its weights (and the syncs)."""
    models, board = _models(), _Board()
    syncs = [_stub_sync(r, m, board, _Manager()) for r, m in enumerate(models)]
    gens = [_noise(r) for r in range(2)]
    after = []
    for step in range(1, STEPS + 1):
        for m, sync, gen in zip(models, syncs, gens):
            _inner_step(m.parameters(), gen)
            sync.after_step(step)
        after.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return [after, syncs]


def test_streaming_fault_tolerant_replicas_equal_float64_reference() -> None:
    after, syncs = _run()
    torch.manual_seed(0)
    start = [p.detach().clone() for p in torch.nn.Linear(128, 64).parameters()]
    _assert_matches(after, _reference(start, SPARSE, 2))
    assert [s.attempts for s in syncs] == [[1, 1]] * 2  # arrivals at 5 and 8 (the sync sent at 9 is in flight)


def _peer_payload(model: torch.nn.Module, shift: float = 0.0):
    """A payload of a peer outside this process, encoded against `model`'s weights (+ shift: the peer's global)."""
    from nanotron_ext.sparseloco.fault import SENDS
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter

    g = [p.detach().clone() + shift for p in model.parameters()]
    peer_local = [t + 0.03 * torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) for t in g]
    oracle = SparseLoCoOuter(g, _cfg(SPARSE, 2))
    payload = torch.cat([torch.tensor([SENDS], dtype=torch.uint8), oracle.encode(peer_local, oracle.new_error())])
    return g, oracle, payload


def _alone(dies: int, max_retries: int = 3, heal_in: Optional[Dict[int, object]] = None, shift: float = 0.0):
    """Replica 0 against a fixed peer payload, steps 1..5 (send at 3, arrival at 5)."""
    model = _models()[0]
    g, oracle, peer = _peer_payload(model, shift)
    board = _Board(dies, peer)
    sync = _stub_sync(0, model, board, _Manager(heal_in(g) if heal_in else None), max_retries)
    gen = _noise(0)
    for step in range(1, 6):
        _inner_step(model.parameters(), gen)
        sync.after_step(step)
    return sync, board, oracle, peer, g


def test_a_peer_dying_in_flight_is_retried_with_the_payload_sent_at_the_start() -> None:
    """The gather dies twice at the arrival (half-written buffers); the third attempt commits. Weights, global weights
    and error feedback equal the clean run's bit for bit; the retries gathered the payload sent at step 3 although
    the weights moved since; two failures with max_retries=1 stop the run with one error."""
    from nanotron_ext.errors import TrainingError

    (clean, _, _, _, _), (retried, board, _, _, _) = _alone(0), _alone(2)
    assert clean.attempts == [1] and retried.attempts == [3]
    for a, b in zip(clean.error + clean.params + clean.outer.global_params,
                    retried.error + retried.params + retried.outer.global_params):
        assert torch.equal(a, b)
    assert len(board.inputs) == 3 and all(torch.equal(board.inputs[k][0], board.inputs[0][0]) for k in (1, 2))
    with pytest.raises(TrainingError, match="max_retries=1"):
        _alone(2, max_retries=1)


def test_a_replica_healed_in_the_retry_takes_global_new_with_zero_error() -> None:
    """Replica 0's gather dies in flight; the retry's quorum heals it from the peer (global weights G, outer momentum,
    sync count 1); it sends nothing, and after the commit holds G after that sync's outer step from the peer's payload
    (the blocking sync's outer step, computed apart), with zero error feedback."""
    momentum: List[torch.Tensor] = []

    def state(g: List[torch.Tensor]) -> Dict[int, object]:
        momentum.extend(torch.full_like(t, 0.01) for t in g)
        return {2: {"global": g, "momentum": momentum, "syncs": 1}}  # quorum 1: the send; 2: the retry

    sync, board, oracle, peer, g = _alone(1, heal_in=state, shift=0.5)
    assert sync.attempts == [2] and sync.healed and sync.outer.syncs == 2
    assert not board.inputs[1][0].any()  # healed: the all-zero payload (flag ABSENT)
    for m, mo in zip(oracle.momentum, momentum):
        m.copy_(mo)
    oracle.apply([peer[1:]])
    for p, want, got in zip(sync.params, oracle.global_params, sync.outer.global_params):
        assert torch.equal(got, want) and torch.equal(p.detach(), want)
    assert not any(e.any() for e in sync.error)


def test_a_checkpoint_with_the_sync_in_flight_resumes_bit_exactly() -> None:
    """Replica 0 against a fixed peer payload: checkpointed at step 4 (sent at 3, due at 5), rebuilt from the
    checkpoint and the step-4 weights, step 5 gives the straight run's weights, global weights and error feedback
    bit for bit; the resumed arrival gathered the payload sent at step 3 again. Healed at its join instead (the
    others went on), the resumed replica drops the sync it held in flight."""
    import copy

    straight, _, _, _, _ = _alone(0)
    model = _models()[0]
    _, _, peer = _peer_payload(model)
    sync = _stub_sync(0, model, _Board(0, peer), _Manager())
    gen = _noise(0)
    for step in range(1, 5):
        _inner_step(model.parameters(), gen)
        sync.after_step(step)
    state = copy.deepcopy(sync.state_dict())
    assert state["in_flight"] is not None
    weights = copy.deepcopy(model.state_dict())

    resumed_model = _models()[0]
    resumed_model.load_state_dict(weights)
    board = _Board(0, peer)
    resumed = _stub_sync(0, resumed_model, board, _Manager())
    resumed.load_state_dict(state)
    _inner_step(resumed_model.parameters(), gen)
    resumed.after_step(5)
    assert resumed.attempts == [1] and resumed.outer.syncs == 1
    assert torch.equal(board.inputs[0][0], state["in_flight"]["payload"])
    for a, b in zip(straight.error + straight.params + straight.outer.global_params,
                    resumed.error + resumed.params + resumed.outer.global_params):
        assert torch.equal(a, b)

    g = [p.detach().clone() + 0.5 for p in model.parameters()]
    healed = _stub_sync(0, _models()[0], _Board(0, peer),
                        _Manager(heal_in={1: {"global": g, "momentum": [torch.zeros_like(t) for t in g], "syncs": 1}}))
    healed.load_state_dict(copy.deepcopy(state))
    assert healed.flight is not None
    healed.start()
    assert healed.healed and healed.flight is None
