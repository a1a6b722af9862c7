"""Streaming outer sync + torchft + heterogeneous replicas together (sparseloco.streaming.delay with
sparseloco.fault_tolerance and sparseloco.compressed_replicas): two fault_streaming.StreamingFaultTolerantSparseLoCoSync
replicas, each with its own heterogeneous hook on a stand-in model (replica 0 compressed), torchft's Manager and
process group replaced by the stand-ins of tests/test_sparseloco_streaming_fault.py, in one process. Every replica's
T_fixed and T_fixed + T_S after every step is held to the float64 simulation of
tests/test_sparseloco_streaming_hetero.py (written from the papers' equations, not from this code), for:

- no fault: both replicas in every sync;
- membership schedules with heals: a replica healed by torchft in its quorum at a send takes the peer's global
  weights, outer momentum, sync count and T_fixed, zero error feedback, and sends nothing (replica 0 at the first
  send and replica 1 at the third; or each in turn at every send). The float64 reference for that schedule is the
  emulated-churn one (the absent replica's payload dropped, its error zeroed, its weights the global ones at the
  send; it trains the tau steps and merges on arrival), and the run without it must not match.

Not covered here: a retry at the arrival (a peer dying in flight; tests/test_sparseloco_streaming_fault.py, without
heterogeneous replicas), since both stand-in replicas run in one thread.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from tests.test_sparseloco_hetero import _Replica
from tests.test_sparseloco_streaming_fault import _Board, _Manager
from tests.test_sparseloco_streaming_hetero import STEPS, _assert_matches, _config, _moves, _reference

pytest.importorskip("torchft")  # fault.py imports it at module level (the `ft` extra)

DELAY, ALPHA = 2, 0.5  # H = 3: sends at 3, 6, 9, 12; arrivals at 5, 8, 11


class _HealingManager(_Manager):
    """The stand-in Manager whose quorums named in `heal_at` (1-based) heal this replica from the live peer's state
    (what torchft's recovery serves: the peer's _peer_state)."""

    def __init__(self, heal_at: Tuple[int, ...]) -> None:
        super().__init__()
        self.heal_at, self.peer = heal_at, None

    def start_quorum(self) -> None:
        super().start_quorum()
        if self.quorums in self.heal_at:
            self.sync._load_peer_state(self.peer._peer_state())


def _ft_sync(replica: int, model: torch.nn.Module, board: _Board, manager: _Manager, cfg):
    """The sync's own state as fault_streaming builds it, torchft replaced by the stand-ins; the heterogeneous hook
    made as outer.SparseLoCoSync makes it (the table split before the global copy is taken)."""
    from nanotron_ext.parallel.comm import CommLedger
    from nanotron_ext.sparseloco.config import FaultToleranceConfig
    from nanotron_ext.sparseloco.fault_streaming import StreamingFaultTolerantSparseLoCoSync
    from nanotron_ext.sparseloco.hetero import hetero_hook
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter

    scfg = cfg.sparseloco
    scfg.fault_tolerance = FaultToleranceConfig(enabled=True, replica=replica, replicas=2)
    sync = object.__new__(StreamingFaultTolerantSparseLoCoSync)
    sync.scfg, sync.ft, sync.ledger, sync.attempts = scfg, scfg.fault_tolerance, CommLedger(), []
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sync.names, sync.params = [n for n, _ in named], [p for _, p in named]
    sync.hooks = [hetero_hook(cfg, {replica: model}, syncs=lambda: sync.outer.syncs)]
    sync.hetero = sync.hooks[0]
    sync.outer = SparseLoCoOuter(sync.params, scfg, sync.names)
    sync.error = sync.outer.new_error()
    sync.pg, sync.manager = board.group(replica), manager
    manager.sync = sync
    sync.lighthouse = SimpleNamespace(wait=lambda: None, during=lambda: __import__("contextlib").nullcontext())
    sync.is_main, sync.healed, sync._fixed_from_peer = False, False, False
    sync.delay, sync.alpha, sync.flight = scfg.streaming.delay, scfg.streaming.alpha, None
    return sync


def _run(heal_at: Dict[int, Tuple[int, ...]]):
    """Both replicas through STEPS seeded inner steps (the same moves as the float64 reference); per step, per
    replica: (T_S, T_fixed). Also the start table T and U, and the syncs."""
    models = {0: _Replica(True), 1: _Replica(False)}
    board = _Board()
    managers = {r: _HealingManager(heal_at.get(r, ())) for r in models}
    syncs = {r: _ft_sync(r, m, board, managers[r], _config(DELAY, ALPHA, [0])) for r, m in models.items()}
    for r in models:
        managers[r].peer = syncs[1 - r]
    embs = [m.embedding for m in models.values()]
    start = (embs[0].table.weight + embs[0].hub.fixed).detach().clone()  # T, split in two
    basis = embs[0].hub.basis.clone()
    got: List[List[Tuple[torch.Tensor, torch.Tensor]]] = []
    for step, moves in enumerate(_moves(), 1):
        for r, (emb, move) in enumerate(zip(embs, moves)):
            with torch.no_grad():
                emb.table.weight.add_(move)
            syncs[r].after_step(step)
        got.append([(e.table.weight.detach().clone(), e.hub.fixed.clone()) for e in embs])
    assert len(got) == STEPS
    return start, basis, got, syncs


def test_streaming_torchft_heterogeneous_replicas_equal_float64_reference() -> None:
    start, basis, got, syncs = _run({})
    _assert_matches(got, _reference(start, basis, DELAY, ALPHA))
    assert [s.attempts for s in syncs.values()] == [[1, 1, 1]] * 2  # arrivals at 5, 8, 11 (12's in flight)
    with pytest.raises(AssertionError):  # the control: the blocking sync's reference
        _assert_matches(got, _reference(start, basis, 0, ALPHA))


@pytest.mark.parametrize("heal_at,churn", [({0: (1,), 1: (3,)}, (1, 2)), ({0: (1, 3), 1: (2, 4)}, (1, 1))])
def test_heals_at_sends_equal_float64_reference_of_that_membership_schedule(
        heal_at: Dict[int, Tuple[int, ...]], churn: Tuple[int, int]) -> None:
    """Healed in the quorums `heal_at` names (quorum q: the send at step 3 q), as the emulated-churn reference drops
    replicas: period 2, sync 0's replica 0 and sync 2's replica 1; period 1, replica 0 and 1 in turn in every sync
    (replica 1 healed at the send at 6 holding the error feedback of its first sync: zeroed, or its payload at 9
    differs)."""
    start, basis, got, syncs = _run(heal_at)
    _assert_matches(got, _reference(start, basis, DELAY, ALPHA, churn=churn))
    assert all(s.outer.syncs == 3 for s in syncs.values())
    with pytest.raises(AssertionError):  # the control: the schedule without the heals
        _assert_matches(got, _reference(start, basis, DELAY, ALPHA))
