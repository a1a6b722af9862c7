"""The streaming outer sync on torchft (sparseloco.streaming.delay = tau > 0 with sparseloco.fault_tolerance.enabled):
fault.FaultTolerantSparseLoCoSync's quorum, payload and vote, split around the next tau inner steps as
streaming.StreamingSparseLoCoSync splits the DP sync.

- Send (every multiple t of H): a torchft quorum (synchronous: a replica behind it is healed here from a live peer),
  the payload encoded on a copy of the error feedback, its all_gather issued on torchft's group and left running
  (torchft's gloo / NCCL work is asynchronous: no side thread).
- Arrival (t + tau): wait for the gather, torchft's commit vote; on yes the outer step from the senders' payloads,
  then each replica merges it, local = alpha local + (1 - alpha) global_new, and keeps the error copy.
- A heal never finds a sync in flight on the peer that serves it: quorums happen only at a send, where the previous
  sync has arrived (tau < H), or at an arrival's retry, where the in-flight sync is the one being retried. The
  healing state is therefore what fault.py sends (global weights, outer momentum, sync count, T_fixed), and the
  in-flight part is the payloads themselves, which the healed replica receives by taking part in the gather
  without a payload of its own: at the send (it then trains the tau steps from the global weights and merges on
  arrival like the others; sparseloco.churn emulates this case), or in a retry (it takes global_new, having
  nothing of its own to merge).
- A peer dying during the flight fails the gather, so the vote; the sync is retried at once with the next quorum:
  every replica gathers the payload it sent at t again (not one re-encoded from weights trained since), from the
  same global weights and error feedback, up to sparseloco.fault_tolerance.max_retries times.
- A (re)starting replica joins with fault.py's blocking sync without a payload (`start`): healed at the others'
  next quorum, it takes the outer step of that sync at once (the vote is per replica group in torchft, so it does
  not wait for the others' arrival) and trains from global_new.
- A checkpoint taken with a sync in flight holds this replica's payload and error copy (not the gathered ones: that
  sync was never voted on). Resumed, the sync is taken like a retry at its arrival: a quorum, every replica gathers
  again the payload it sent (the same bytes), vote, outer step, merge: bit for bit as the run that went on, when
  every replica resumes. A replica healed at its join (`start`: the others went on) drops it, as its peer's state
  has it applied. (A replica meeting, in that quorum, one at the same committed step without it would gather with
  that one's next send: the same outer sync, encoded against the same global weights; reasoned, not tested.)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.sparseloco.fault import ABSENT, SENDS, FaultTolerantSparseLoCoSync, _first_line
from nanotron_ext.sparseloco.streaming import StreamingSchedule, merge_


class _Flight:
    """One outer sync between its send and its arrival: this replica's payload (flag byte first), the error feedback
    it leaves if committed, whether it takes global_new rather than merging (healed in a retry), and the gather in
    progress (None where it could not be issued: the vote then fails)."""

    def __init__(self, payload: torch.Tensor, error: List[torch.Tensor], take: bool = False,
                 resumed: bool = False) -> None:
        self.payload, self.error, self.take, self.resumed = payload, error, take, resumed
        self.work: Any = None
        self.gathered: Optional[List[torch.Tensor]] = None
        self.split: Optional[str] = None  # its quorum healed only some of this replica's ranks (fault._heal_split)


class StreamingFaultTolerantSparseLoCoSync(StreamingSchedule, FaultTolerantSparseLoCoSync):
    """FaultTolerantSparseLoCoSync with its outer sync in flight for sparseloco.streaming.delay inner steps."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Any) -> None:
        super().__init__(model, ctx, cfg)
        self.delay, self.alpha = self.scfg.streaming.delay, self.scfg.streaming.alpha
        assert 0 < self.delay < self.scfg.inner_steps  # the config's rule; delay 0 builds FaultTolerantSparseLoCoSync
        self.flight: Optional[_Flight] = None

    def send(self) -> None:
        """Quorum (a heal here: global weights taken, no payload sent), encode, issue the gather, return."""
        assert self.flight is None, "an outer sync is still in flight (sparseloco.streaming.delay >= inner_steps?)"
        self.healed = False
        self._quorum()
        split = self._heal_split()  # collective over this replica's ranks
        for hook in self.hooks:
            hook(self.replica, self.params, "before_encode")
        error = [e.clone() for e in self.error]  # error feedback changes only with a committed sync
        sends = not self.healed
        body = (self.outer.encode(self.params, error) if sends else
                torch.zeros(self.outer.payload_nbytes(), dtype=torch.uint8, device=self.global_device))
        flag = torch.tensor([SENDS if sends else ABSENT], dtype=torch.uint8, device=body.device)
        self.flight = _Flight(torch.cat([flag, body]), error)
        self._issue(self.flight)
        if split is not None:  # the vote at the arrival fails; after the retry every rank takes global_new, dropping
            self.manager.report_error(RuntimeError(split))  # the tau steps trained on shards of different syncs
            self.flight.split, self.flight.take = split, True

    def _issue(self, flight: _Flight) -> None:
        """Start the gather of `flight`'s payload over the quorum's group (nothing where torchft reported an error)."""
        flight.work, flight.gathered = None, None
        if self.manager.errored() is not None:  # an unconfigured group (a failed heal): the vote fails
            return
        self.ledger.record("quorum", 0, self.pg)
        from torch.distributed.distributed_c10d import AllgatherOptions

        try:  # size() too: an unconfigured torchft group asserts there
            flight.gathered = [torch.empty_like(flight.payload) for _ in range(self.pg.size())]
            flight.work = self.pg.allgather([flight.gathered], [flight.payload], AllgatherOptions())
        except Exception as e:  # noqa: BLE001 - a dead peer: torchft's vote turns it into a retry
            self.manager.report_error(e)
            flight.gathered = None
            return
        self.ledger.record("all_gather", flight.payload.numel(), self.pg)

    def _wait(self, flight: _Flight) -> Optional[List[torch.Tensor]]:
        if flight.work is None:
            return None
        try:
            flight.work.wait()
        except Exception as e:  # noqa: BLE001 - a peer died during the flight
            self.manager.report_error(e)
            return None
        finally:
            flight.work = None
        return flight.gathered

    def arrive(self) -> None:
        """Wait for the gather, vote, apply and merge; on a failed vote retry at once with the next quorum."""
        flight, self.flight = self.flight, None
        split = flight.split
        for attempt in range(self.ft.max_retries + 1):
            if attempt or flight.resumed:  # a retry, or a sync read back from a checkpoint: gathered again
                self.healed = False
                self._quorum()  # a heal here: the global weights the in-flight sync applies to, error zero
                split = self._heal_split()
                if self.healed:  # ABSENT is 0: an all-zero payload
                    flight = _Flight(torch.zeros_like(flight.payload), [e.clone() for e in self.error], take=True)
                self._issue(flight)
                if split is not None:  # fault.py's sync: no part of the replica commits
                    self.manager.report_error(RuntimeError(split))
            payloads = self._wait(flight)
            self.ledger.record("commit", 0, self.pg)
            if self.manager.should_commit():
                self.error = flight.error
                self.attempts.append(attempt + 1)
                self._share_fixed_over_pipeline()
                senders = [p[1:] for p in payloads if p[0] == SENDS] if payloads is not None else []
                self._arrived(senders, flight.take)
                return
            if attempt < self.ft.max_retries:
                error = self.manager.errored()
                self._say(f"sparseloco.fault_tolerance: replica {self.replica}: outer sync {self.outer.syncs + 1} "
                          f"attempt {attempt + 1} failed ({_first_line(getattr(error, 'original_exception', error))}); "
                          f"retrying with the next quorum (streaming: the payloads sent at the sync's start)")
        raise self._failed(split)

    def _arrived(self, senders: List[torch.Tensor], take: bool) -> None:
        """The outer step from `senders`; this replica merges it (`take`: healed in a retry, it takes global_new)."""
        if not senders:  # no outer step: a replica healed in this retry already holds the global weights
            return
        self.outer.apply(senders)
        for hook in self.hooks:
            hook(self.replica, self.outer.global_params, "after_apply")
        if take:
            self.outer.load_into(self.params)
        else:
            merge_(self.params, self.outer.global_params, self.alpha)
        keep = self.hetero.keep if self.hetero is not None else 0.0
        if self.hetero is not None and take:  # its T_S is the folded global copy: no share of the fold to give up
            self.hetero.keep = 0.0
        try:
            for hook in self.hooks:
                hook(self.replica, self.params, "after_sync")
        finally:
            if self.hetero is not None:
                self.hetero.keep = keep

    def start(self) -> None:
        """fault.py's join; a replica healed there drops the sync its checkpoint held in flight (the peer's state has
        it applied, or it was never committed by anyone)."""
        super().start()
        if self.healed:
            self.flight = None

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if self.flight is not None:  # this replica's payload and error copy: the sync is gathered again on resume
            state["in_flight"] = {"payload": self.flight.payload, "error": dict(zip(self.names, self.flight.error))}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pending = state.get("in_flight") if state else None
        super().load_state_dict({k: v for k, v in state.items() if k != "in_flight"} if state else state)
        self.flight = None
        if pending is not None:
            size = self.outer.payload_nbytes() + 1
            if not isinstance(pending, dict) or pending["payload"].numel() != size:
                raise ValueError(f"sparseloco checkpoint: the in-flight outer sync is not a fault-tolerant replica's "
                                 f"payload of {size} B (saved with another sparseloco.fault_tolerance setting?)")
            device = self.global_device
            error = [pending["error"][n].to(device) for n in self.names]
            self.flight = _Flight(pending["payload"].to(device), error, resumed=True)

    def close(self) -> None:
        if self.flight is not None:  # let the last gather finish before torchft's group goes away under a peer
            self._wait(self.flight)
            self.flight = None
        super().close()
