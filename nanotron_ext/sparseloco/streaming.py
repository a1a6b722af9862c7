"""The streaming outer sync (sparseloco.streaming.delay = tau > 0; "Streaming DiLoCo with overlapping communication",
Douillard et al. 2025, arXiv:2501.18512, with one fragment: the whole model) for SparseLoCo and dense DiLoCo
(top-k = chunk): the pseudo-gradient is encoded at step t (every multiple of H = inner_steps), as in the blocking
sync, but its all_gather runs on a side thread while the replica takes its next inner steps; at step t + tau the
payloads are aggregated, the outer step is taken from the global weights and each replica merges it into the
weights it trained meanwhile: local = alpha * local + (1 - alpha) * global_new (torchft's local_sgd.DiLoCo with
fragment_sync_delay = tau, fragment_update_alpha = alpha). The next pseudo-gradient is taken against that global_new.

What overlaps: the collective itself (and, under parallelism.link, its emulated ring time, slept by the link hook on
the thread that issues it). What does not: encoding (error feedback, top-k, packing) at t and decoding, aggregation,
the outer step and the merge at t + tau run between inner steps on the training thread. The side thread uses its
own copy of the DP group (`side_dp_group`), so its collective never interleaves with the training thread's own on
the DP group (the logged loss's all-reduce). The payload is the blocking sync's, byte for byte, and the ledger counts
it under "dp" as "all_gather" (recorded by the side thread, so in whichever step's window it was issued).

Emulated churn (sparseloco.churn): the absent replica encodes and sends as usual (its slot crosses), takes the global
weights at the send (it rejoins there, healed with what a live peer holds: the global weights; the in-flight payloads
reach it as they reach everyone), trains the tau steps from them and merges on arrival as the others do; its payload
is dropped and its error feedback zeroed on arrival (outer.SparseLoCoOuter.drop_absent).

Fault tolerance (sparseloco.fault_tolerance, torchft): fault_streaming.StreamingFaultTolerantSparseLoCoSync.

Heterogeneous replicas (sparseloco.compressed_replicas): the embedding fold runs on arrival; each replica's T_S also
gives up alpha of the fold after its merge (hetero.HeteroHook), so T_fixed + T_S is plain streaming's merged table.

A checkpoint taken while a sync is in flight waits for its payloads and saves them (every replica's, as gathered):
a resume applies them at the same step, bit for bit as the run that went straight on.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.sparseloco.outer import SparseLoCoSync


def side_dp_group(ctx: ParallelContext) -> dist.ProcessGroup:
    """A second process group over this rank's DP group, for collectives issued off the training thread. Every rank
    creates every DP group's copy, in the same order (torch.distributed.new_group is collective over the world)."""
    ranks = ctx.world_rank_matrix  # (ep, pp, dp, tp), as nanotron's ParallelContext builds dp_pg
    mine = None
    for group_ranks in ranks.transpose((3, 0, 1, 2)).reshape((-1, ranks.shape[2])):
        pg = dist.new_group(ranks=[int(r) for r in group_ranks])
        if dist.get_rank() in group_ranks:
            mine = pg
    assert mine is not None
    get_ledger().name_group(mine, "dp")  # its bytes are DP traffic, and the dp tier's emulated link delays them
    return mine


class InFlightGather:
    """One all_gather of equal-size payloads running on a daemon thread; `result()` waits for it (once)."""

    def __init__(self, payload: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.gathered = [torch.empty_like(payload) for _ in range(group.size())]
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(payload, group), name="sparseloco-outer-sync",
                                       daemon=True)
        self.thread.start()

    def _run(self, payload: torch.Tensor, group: dist.ProcessGroup) -> None:
        try:
            if payload.is_cuda:  # a new thread starts on device 0; NCCL then waits on this thread's current stream,
                torch.cuda.set_device(payload.device)  # the device's default one, where the payload was encoded
            dist.all_gather(self.gathered, payload, group=group)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by result()
            self.error = e

    def result(self) -> List[torch.Tensor]:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"sparseloco streaming outer sync: the all_gather failed: {self.error}") from self.error
        return self.gathered


class Arrived:
    """Payloads already gathered (read back from a checkpoint), in InFlightGather's shape."""

    def __init__(self, gathered: List[torch.Tensor]) -> None:
        self.gathered = gathered

    def result(self) -> List[torch.Tensor]:
        return self.gathered


@torch.no_grad()
def merge_(params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor], alpha: float) -> None:
    """Streaming DiLoCo's merge: each local p becomes alpha * p + (1 - alpha) * g (torch.lerp from g towards p)."""
    for p, g in zip(params, global_params):
        p.copy_(torch.lerp(g, p.detach().float(), alpha))


class StreamingSchedule:
    """The streaming sync's cadence, shared by the one-job and the torchft sync: at step t + tau (t a multiple of H)
    the sync in flight arrives, at every multiple of H the next one is sent (the subclass's `arrive` and `send`)."""

    scfg: Any
    delay: int
    flight: Any

    def after_step(self, step: int) -> None:
        h = self.scfg.inner_steps
        if step % h == self.delay and self.flight is not None:
            self.arrive()
        if step % h == 0:
            self.send()

    def arrive(self) -> None:
        raise NotImplementedError

    def send(self) -> None:
        raise NotImplementedError


class StreamingSparseLoCoSync(StreamingSchedule, SparseLoCoSync):
    """SparseLoCoSync with the outer sync in flight for sparseloco.streaming.delay inner steps."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Any) -> None:
        super().__init__(model, ctx, cfg)
        self.delay, self.alpha = self.scfg.streaming.delay, self.scfg.streaming.alpha
        assert 0 < self.delay < self.scfg.inner_steps  # the config's rule; delay 0 builds SparseLoCoSync
        self.side_pg = side_dp_group(ctx)
        self.flight: Optional[InFlightGather | Arrived] = None

    def send(self) -> None:
        """Encode this replica's payload (error feedback updated now) and start its all_gather on the side thread."""
        assert self.flight is None, "an outer sync is still in flight (sparseloco.streaming.delay >= inner_steps?)"
        for hook in self.hooks:
            hook(self.replica, self.params, "before_encode")
        self.flight = InFlightGather(self.outer.encode(self.params, self.error), self.side_pg)
        if self.outer.absent(self.dp_pg.size()) == self.replica:  # emulated churn: it rejoins now, healed
            self.outer.load_into(self.params)

    def arrive(self) -> None:
        """Wait for the payloads (usually long there), take the outer step on the global weights, merge."""
        gathered = list(self.flight.result())
        self.flight = None
        self.outer.drop_absent(gathered, {self.replica: self.error})
        self.outer.apply(gathered)
        for hook in self.hooks:
            hook(self.replica, self.outer.global_params, "after_apply")
        merge_(self.params, self.outer.global_params, self.alpha)
        for hook in self.hooks:
            hook(self.replica, self.params, "after_sync")

    def sync(self) -> None:
        """A whole outer sync at once (send, then arrive): what a caller outside the step loop asks for."""
        self.send()
        self.arrive()

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["in_flight"] = None if self.flight is None else list(self.flight.result())  # waits for it
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pending = state.get("in_flight") if state else None
        super().load_state_dict({k: v for k, v in state.items() if k != "in_flight"} if state else state)
        self.flight = None
        if pending is not None:
            size = self.outer.payload_nbytes()
            if len(pending) != self.dp_pg.size() or any(t.numel() != size for t in pending):
                raise ValueError(f"sparseloco checkpoint: the in-flight outer sync holds {len(pending)} payloads of "
                                 f"{[t.numel() for t in pending][:4]} B; this run has {self.dp_pg.size()} replicas "
                                 f"of {size} B")
            self.flight = Arrived([t.to(self.outer.global_params[0].device) for t in pending])
