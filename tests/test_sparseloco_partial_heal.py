"""A heal that reaches only some of a replica's ranks (nanotron_ext.sparseloco.fault._heal_split), forced with
stand-ins for torchft in one process: replica 1 is a two-rank job (two threads), each rank its own torchft Manager
healing from its peer rank of replica 0, whose state is two outer syncs ahead. In the first quorum rank 0 heals and
rank 1's transfer is cut short (torchft reports it and leaves rank 1's group unconfigured); torchft's vote is per
replica group (every rank must vote yes), so that attempt fails on both.

- the peer is still there for the retry: rank 1 heals then; both ranks end the sync with the outer step of the
  peer's state on the peer's payload alone (a reference computed from the peer's state, bit for bit), zero error
  feedback, the same sync count. Before the fix rank 0, healed in the failed attempt, sent a zero delta in the
  retry as if it had trained, and its outer step differed from rank 1's;
- the peer exited while serving (3-host run, /tmp logs of `ft_hosts --kill-host 2`): nobody to heal from in the
  retry. Before the fix the replica committed with rank 0 at the peer's sync and rank 1 at its own; now every
  attempt fails and both ranks end with the same one-line error naming the ranks on each side.
"""
from __future__ import annotations

import copy
import threading
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import pytest
import torch

from tests.test_sparseloco_fault_heal import _stub_sync

pytest.importorskip("torchft")  # fault.py imports it when the sync is built (the `ft` extra)

RANKS = 2


class _Replica:
    """What the ranks of one replica share: a barrier for the collectives among them (their world group's
    all_gather, torchft's commit vote, aggregated over the replica group's ranks by its manager server)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(RANKS, timeout=20)
        self.slots: List[object] = [None] * RANKS

    def exchange(self, rank: int, value: object) -> List[object]:
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them
        return seen


class _RankGroup:
    """Rank `rank`'s view of its replica's world group (what fault.py's all_gather runs over)."""

    def __init__(self, replica: _Replica, rank: int) -> None:
        self.replica, self.rank = replica, rank

    def size(self) -> int:
        return RANKS


def _all_gather(out: List[torch.Tensor], tensor: torch.Tensor, group: _RankGroup) -> None:
    for o, t in zip(out, group.replica.exchange(group.rank, tensor.clone())):
        o.copy_(t)


class _Manager:
    """torchft.Manager for one rank: quorum k runs `script[k]` ("heal": vetted and applied as torchft does; "cut":
    the transfer broken off, the error reported and the group left unconfigured); the vote is the replica's."""

    def __init__(self, sync: object, rank: int, replica: _Replica, state: dict, script: Dict[int, str]) -> None:
        self.sync, self._group_rank, self.replica, self.state, self.script = sync, rank, replica, state, script
        self.err: Optional[Exception] = None
        self.quorums = 0

    def start_quorum(self) -> None:
        self.err, self.quorums = None, self.quorums + 1
        self.sync.pg.quorum = self.quorums
        action = self.script.get(self.quorums)
        self.sync.pg.configured = action != "cut"
        if action == "cut":
            self.report_error(RuntimeError("the healing state was broken off"))
        elif action == "heal":
            self.sync._vet_peer_state(self.state, self.state["torchft"]["step"], "http://127.0.0.1:1/checkpoint/")
            self.sync._load_peer_state(copy.deepcopy(self.state["user"]["default"]))

    def errored(self) -> Optional[Exception]:
        return self.err

    def report_error(self, e: Exception) -> None:
        self.err = e

    def should_commit(self) -> bool:
        return all(self.replica.exchange(self._group_rank, self.err is None))


class _PeerGroup:
    """torchft's group between this rank and its peer rank of replica 0: the peer takes part in the quorums listed
    in `peer_in` (afterwards this replica is alone); unconfigured after a cut heal (size() asserts, as torchft's)."""

    def __init__(self, peer_payload: torch.Tensor, peer_in: List[int]) -> None:
        self.peer, self.peer_in = peer_payload, peer_in
        self.quorum, self.configured = 0, True

    def size(self) -> int:
        assert self.configured, "process group not initialized"  # torchft's ProcessGroupWrapper.parent
        return 2 if self.quorum in self.peer_in else 1

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: object) -> object:
        outputs[0][0].copy_(inputs[0])
        if self.size() == 2:
            outputs[0][1].copy_(self.peer)
        return SimpleNamespace(wait=lambda: None)


def _run_replica(peer_in: List[int], monkeypatch: pytest.MonkeyPatch):
    """Replica 1's two ranks through one outer sync; returns (their syncs, what each raised, the peer's state)."""
    from nanotron_ext.sparseloco import fault

    monkeypatch.setattr(fault, "dist", SimpleNamespace(all_gather=_all_gather))
    peer = _stub_sync(0)
    peer.sync(), peer.sync()  # two outer syncs ahead
    state = {"user": {"default": peer._peer_state()}, "torchft": {"step": 2}}
    replica = _Replica()
    scripts = [{1: "heal"}, {1: "cut", 2: "heal"} if 2 in peer_in else {1: "cut"}]
    ranks = []
    for rank, script in enumerate(scripts):
        sync = _stub_sync(0)
        sync.ft.replica, sync.max_syncs, sync.is_main = 1, None, rank == 0
        sync.pg = _PeerGroup(sync.pg.peer, peer_in)
        sync.manager = _Manager(sync, rank, replica, state, script)
        sync.replica_pg = _RankGroup(replica, rank)
        ranks.append(sync)
    return ranks, _on_every_rank(lambda rank: ranks[rank].sync()), peer


def _on_every_rank(run: Callable[[int], None]) -> List[Optional[BaseException]]:
    """`run(rank)` on RANKS threads at once; what each raised."""
    raised: List[Optional[BaseException]] = [None] * RANKS

    def guarded(rank: int) -> None:
        try:
            run(rank)
        except Exception as e:  # noqa: BLE001 - compared by the caller
            raised[rank] = e
    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is left waiting in a collective"
    return raised


def test_a_heal_cut_short_on_one_rank_is_completed_by_the_retry_on_every_rank(monkeypatch, capsys) -> None:
    from nanotron_ext.sparseloco.fault import SENDS
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter

    ranks, raised, peer = _run_replica([1, 2], monkeypatch)
    assert raised == [None, None], raised
    sent = ranks[0].pg.peer
    assert sent[0] == SENDS
    reference = SparseLoCoOuter([g.clone() for g in peer.outer.global_params], peer.scfg)
    reference.apply([sent[1:]])  # the healed sync's outer step: the live peer's payload alone
    for sync in ranks:
        assert sync.attempts == [2] and sync.outer.syncs == 3
        for ours, ref in zip(sync.outer.global_params + sync.params, reference.global_params * 2):
            assert torch.equal(ours.detach(), ref)
        assert not any(e.any() for e in sync.error)
    said = capsys.readouterr().err
    assert "replica 1: a heal reached only some of its ranks (ranks 0 healed to outer sync 2; ranks 1 at outer " \
           "sync 0)" in said, said


def test_a_heal_cut_short_with_no_peer_left_ends_every_rank_with_one_line(monkeypatch) -> None:
    from nanotron_ext.errors import TrainingError

    ranks, raised, _ = _run_replica([1], monkeypatch)
    assert all(isinstance(e, TrainingError) for e in raised), raised
    lines = {str(e) for e in raised}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert "\n" not in line and "still so after 3 attempts (sparseloco.fault_tolerance.max_retries=2)" in line, line
    assert "a heal reached only some of its ranks (ranks 0 healed to outer sync 2; ranks 1 at outer sync 0)" in line
    assert [s.attempts for s in ranks] == [[], []]  # no rank committed anything


def test_streaming_a_heal_cut_short_at_the_send_ends_with_every_rank_holding_global_new(monkeypatch) -> None:
    """The streaming sync (fault_streaming): the split heal happens at the send (quorum 1, step 3); the tau inner
    steps run, the arrival's vote fails, the retry's quorum heals rank 1. Both ranks take global_new (the outer step
    of the peer's state on the peer's payload, computed apart) with zero error feedback. Before the fix rank 0,
    healed at the send, merged it with the local weights trained on a model whose shards came from different syncs,
    while rank 1 took it."""
    from nanotron_ext.sparseloco import fault
    from tests.test_sparseloco_streaming import _inner_step, _noise
    from tests.test_sparseloco_streaming_fault import _Board, _Manager, _models, _peer_payload
    from tests.test_sparseloco_streaming_fault import _stub_sync as _streaming_sync

    class _RankManager(_Manager):  # heals or cuts as scripted; the vote is the replica's
        def __init__(self, rank: int, heal_in: Dict[int, object], cut_in: List[int]) -> None:
            super().__init__(heal_in)
            self._group_rank, self.cut_in = rank, cut_in

        def start_quorum(self) -> None:
            super().start_quorum()
            if self.quorums in self.cut_in:
                self.report_error(RuntimeError("the healing state was broken off"))

        def should_commit(self) -> bool:
            return all(replica.exchange(self._group_rank, self.err is None))

    monkeypatch.setattr(fault, "dist", SimpleNamespace(all_gather=_all_gather))
    replica = _Replica()
    g, oracle, peer = _peer_payload(_models()[0], 0.5)
    momentum = [torch.full_like(t, 0.01) for t in g]
    state = {"global": g, "momentum": momentum, "syncs": 1}
    models = [_models()[0] for _ in range(RANKS)]
    managers = [_RankManager(0, {1: state}, []), _RankManager(1, {2: state}, [1])]
    ranks = [_streaming_sync(0, m, _Board(0, peer), mgr) for m, mgr in zip(models, managers)]
    for rank, sync in enumerate(ranks):
        sync.replica_pg = _RankGroup(replica, rank)

    def run(rank: int) -> None:
        gen = _noise(0)
        for step in range(1, 6):  # send at 3 (the split heal), arrival at 5 (vote fails, the retry heals rank 1)
            _inner_step(models[rank].parameters(), gen)
            ranks[rank].after_step(step)
    assert _on_every_rank(run) == [None, None]
    for m, mo in zip(oracle.momentum, momentum):
        m.copy_(mo)
    oracle.apply([peer[1:]])
    for sync in ranks:
        assert sync.attempts == [2] and sync.outer.syncs == 2
        for p, want, got in zip(sync.params, oracle.global_params, sync.outer.global_params):
            assert torch.equal(got, want) and torch.equal(p.detach(), want)
        assert not any(e.any() for e in sync.error)
