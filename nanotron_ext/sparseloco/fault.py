"""Fault-tolerant SparseLoCo on torchft (sparseloco.fault_tolerance.enabled; README "Fault-tolerant SparseLoCo").

Process layout. Each replica is its own job (parallelism.dp = 1, its own tp x pp inner process groups, its own
torchrun and TCPStore) and one torchft replica group (replica id sparseloco_<replica>). Every rank of the job
holds a torchft `Manager` and a torchft `ProcessGroupGloo` (NCCL on CUDA): rank (pp, tp) of replica r gathers
payloads with rank (pp, tp) of the others over that reconfigurable group. A torchft lighthouse (its
`torchft_lighthouse` binary, or `python -m nanotron_ext.sparseloco.ft_launch`) forms the quorums.

Semantics (tests/test_sparseloco_fault.py):
- every outer sync starts with a torchft quorum (`Manager.start_quorum`, synchronous); the payloads of the
  replicas present are all-gathered over the group torchft configured for that quorum, and averaged over the
  replicas that sent one (a one-byte flag heads each payload; `aggregate` = all: over the senders present);
- the sync is applied only when torchft's `should_commit` votes yes; a peer dying mid-collective makes the
  gather fail, the vote no, and the sync is retried with the next quorum (the dead replica dropped) from the
  same global weights and the same error feedback (encoding works on a copy until the commit);
- a replica whose committed step is behind the quorum's (a restarted one, or one whose commit failed where the
  others' succeeded) is healed by torchft from a live peer: the global weights, outer momentum and sync count
  (`_peer_state`), error feedback zero (the dead replica's is lost with it), its local weights set to the
  global ones; it takes part in that same sync without a payload, so after it all replicas hold the same bits;
- a (re)starting replica joins once before its first inner step (`start`, after its own checkpoint is loaded),
  so it trains from the current global weights;
- the ledger counts, under group "ft": the payload all_gather (bytes, flag byte included), "quorum" and
  "commit" calls (torchft's gRPC messages: calls only, their bytes are not visible from Python), "send:recovery"
  on the live peer (the state it staged, once per heal) and "recv:recovery" on the healed replica (bytes of
  tensors; torchft's HTTP/pickle framing is not counted).
Neither templar churn bug can happen here: error feedback lives only in a committed sync (a failed or
absent round leaves it untouched, a heal zeroes it; #537), and payloads are fixed-size, decoded locally after
one bounded collective (#574).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.errors import TrainingError
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.sparseloco.outer import SparseLoCoSync

SENDS, ABSENT = 1, 0  # the payload's first byte


class FaultTolerantSparseLoCoSync(SparseLoCoSync):
    """SparseLoCoSync whose replicas are torchft replica groups (see the module docstring)."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Any) -> None:
        super().__init__(model, ctx, cfg)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        ft = self.scfg.fault_tolerance
        self.ft = ft
        timeout = timedelta(seconds=ft.timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if ctx.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.ledger = get_ledger()
        self.ledger.name_group(self.pg, "ft")
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load_peer_state, state_dict=self._peer_state,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
            rank=dist.get_rank(ctx.world_pg), world_size=ctx.world_pg.size(),
            replica_id=f"sparseloco_{ft.replica}", lighthouse_addr=ft.lighthouse,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), store_port=int(os.environ["MASTER_PORT"]),
        )
        self.healed = False  # set by torchft's recovery during a quorum
        self.attempts: List[int] = []  # attempts each committed sync took (tests, logs)

    @property
    def replica(self) -> int:
        return self.scfg.fault_tolerance.replica

    def data_shard(self, dp_rank: int, dp_size: int) -> Tuple[int, int]:
        return self.ft.replica, self.ft.replicas

    def start(self) -> None:
        """Join the replicas before the first inner step: a quorum and a sync without a payload, so a replica
        that (re)starts while the others train takes the current global weights (healed from a live peer)."""
        self.sync(send=False)

    def sync(self, send: bool = True) -> None:
        """One outer step on torchft: quorum, gather the payloads of the replicas present, commit vote, apply;
        retried with the next quorum when the vote fails (a peer died mid-collective)."""
        for attempt in range(self.ft.max_retries + 1):
            self.healed = False
            self.manager.start_quorum()  # synchronous: a replica behind the quorum is healed here (_load_peer_state)
            self.ledger.record("quorum", 0, self.pg)
            error = [e.clone() for e in self.error]  # error feedback changes only with a committed sync
            payloads = self._gather(send and not self.healed, error)
            self.ledger.record("commit", 0, self.pg)
            if self.manager.should_commit():
                self.error = error
                self.attempts.append(attempt + 1)
                senders = [p[1:] for p in payloads if p[0] == SENDS] if payloads is not None else []
                if senders:
                    self._apply(senders)
                elif self.healed:
                    self.outer.load_into(self.params)
                return
        raise TrainingError(f"sparseloco.fault_tolerance: outer sync {self.outer.syncs + 1} failed "
                            f"{self.ft.max_retries + 1} times (sparseloco.fault_tolerance.max_retries="
                            f"{self.ft.max_retries}); last error: {self.manager.errored()}")

    def _gather(self, send: bool, error: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """All payloads of this quorum (None when the collective failed: torchft then votes no)."""
        for hook in self.hooks:
            hook(self.replica, self.params, "before_encode")
        if send:
            body = self.outer.encode(self.params, error)
        else:
            body = torch.zeros(self.outer.payload_nbytes(), dtype=torch.uint8, device=self.global_device)
        payload = torch.cat([torch.tensor([SENDS if send else ABSENT], dtype=torch.uint8, device=body.device), body])
        if self.manager.errored():
            return None
        from torch.distributed.distributed_c10d import AllgatherOptions

        gathered = [torch.empty_like(payload) for _ in range(self.pg.size())]
        try:
            self.pg.allgather([gathered], [payload], AllgatherOptions()).wait()
        except Exception as e:  # noqa: BLE001 - a dead peer: torchft's vote turns it into a retry
            self.manager.report_error(e)
            return None
        self.ledger.record("all_gather", payload.numel(), self.pg)
        return gathered

    def _apply(self, senders: List[torch.Tensor]) -> None:
        self.outer.apply(senders)
        for hook in self.hooks:
            hook(self.replica, self.outer.global_params, "after_apply")
        self.outer.load_into(self.params)
        for hook in self.hooks:
            hook(self.replica, self.params, "after_sync")

    @property
    def global_device(self) -> torch.device:
        return self.outer.global_params[0].device

    # -- torchft recovery: what a live peer sends, what a healed replica takes ---------------------------
    def _peer_state(self) -> Dict[str, Any]:
        """Staged by torchft for the replicas it heals from this one (served over HTTP once per healed replica)."""
        o = self.outer
        state = {"global": list(o.global_params), "momentum": list(o.momentum), "syncs": o.syncs}
        self.ledger.record("send:recovery", _nbytes(state["global"] + state["momentum"]), self.pg)
        return state

    @torch.no_grad()
    def _load_peer_state(self, state: Dict[str, Any]) -> None:
        o = self.outer
        for dst, src in zip(o.global_params + o.momentum, state["global"] + state["momentum"]):
            dst.copy_(src)
        o.syncs = int(state["syncs"])
        for e in self.error:
            e.zero_()
        o.load_into(self.params)
        self.healed = True
        self.ledger.record("recv:recovery", _nbytes(state["global"] + state["momentum"]), self.pg)
        self._global_loaded()

    # -- checkpoints: the outer state, plus torchft's committed step -----------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "ft": self.manager.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "ft"})
        if "ft" in state:
            self.manager.load_state_dict(state["ft"])

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _nbytes(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
