"""Fault-tolerant SparseLoCo on torchft (sparseloco.fault_tolerance.enabled; docs/techniques/sparseloco.md).

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
- torchft heals rank by rank, each rank from its peer rank's server: a heal can reach only some of a replica's
  ranks (a peer exiting mid-transfer). After every quorum the replica's ranks compare their outer sync counts
  (`_heal_split`); ranks that disagree fail the attempt on every rank of the replica, so no part of it commits and
  the retry heals the rest; still split after max_retries, every rank ends with one line naming both sides;
- a (re)starting replica joins once before its first inner step (`start`, after its own checkpoint is loaded),
  so it trains from the current global weights;
- heterogeneous replicas (sparseloco.compressed_replicas; tests/test_sparseloco_hetero_ft.py): each job builds its
  own replica's model (SparseLoCoTechnique.replica_config reads fault_tolerance.replica). The healing state also
  carries T_fixed (identical on every replica after every sync, sec. 2.4), so a replica of either kind heals from
  a peer of either kind; U comes from its seed; a compressed pipeline's later stages then take T_fixed from stage 0
  (`_share_fixed_over_pipeline`). torchft's step-0 heal (init_sync) gives every replica the same start, as the DP
  and simulated drivers give replica 0's: rank by rank, so at pp = tp = 1 replica 0's, with several stages
  possibly one replica's for one stage and another's for the next (each stage's weights agree across replicas);
- the ledger counts, under group "ft": the payload all_gather (bytes, flag byte included), "quorum" and
  "commit" calls (torchft's gRPC messages: calls only, their bytes are not visible from Python), "send:recovery"
  on the live peer (the state it staged, once per heal) and "recv:recovery" on the healed replica (bytes of
  tensors; torchft's HTTP/pickle framing is not counted).
- peers are not trusted with code (issue 33 row 14): the Manager and the recovery server listen on the local end of
  the route to the lighthouse (ft_peer.bind_host), a healing state is unpickled with weights_only and refused
  unless this run could have produced it (ft_peer.peer_state_problem): a refusal fails the commit vote like a
  dead peer, and the sync is retried;
- a lighthouse that stops answering is waited for, saying so with its address, up to quorum_timeout_s; torchft's
  quorum_retries reconnect to a restarted one; past the bound the run ends naming it (lighthouse.py).
Neither templar churn bug can happen here: error feedback lives only in a committed sync (a failed or
absent round leaves it untouched, a heal zeroes it; #537), and payloads are fixed-size, decoded locally after
one bounded collective (#574).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.errors import TrainingError
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.sparseloco.hetero import FOLD_TAG, HeteroHook
from nanotron_ext.sparseloco.lighthouse import LighthouseWatch, gone, unreachable
from nanotron_ext.sparseloco.outer import SparseLoCoSync

SENDS, ABSENT = 1, 0  # the payload's first byte


class FaultTolerantSparseLoCoSync(SparseLoCoSync):
    """SparseLoCoSync whose replicas are torchft replica groups (see the module docstring)."""

    replica_pg: Any = None  # this replica's own ranks (set in __init__; None: one rank, nothing to agree on)

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Any) -> None:
        super().__init__(model, ctx, cfg)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from nanotron_ext.sparseloco.ft_peer import (
            TensorsOnlyTransport,
            advertised_store,
            bind_host,
            manager_server_bound_to,
            url_host,
        )

        ft = self.scfg.fault_tolerance
        self.ft = ft
        timeout = timedelta(seconds=ft.timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if ctx.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.ledger = get_ledger()
        self.ledger.name_group(self.pg, "ft")
        self.is_main = dist.get_rank(ctx.world_pg) == 0
        self.lighthouse = LighthouseWatch(ft.lighthouse, ft.quorum_timeout_s, self._say)
        self.lighthouse.wait()  # torchft's Manager connects to it: a replica started before it waits, saying so
        train_steps = getattr(getattr(cfg, "tokens", None), "train_steps", None)
        self.max_syncs = train_steps // self.scfg.inner_steps if train_steps is not None else None
        host = bind_host(ft.lighthouse)  # the torchft services listen there, never on all interfaces (row 14)
        with manager_server_bound_to(host):
            self.manager = Manager(
                pg=self.pg, load_state_dict=self._load_peer_state, state_dict=self._peer_state,
                min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
                rank=dist.get_rank(ctx.world_pg), world_size=ctx.world_pg.size(),
                replica_id=f"sparseloco_{ft.replica}", lighthouse_addr=ft.lighthouse, hostname=url_host(host),
                store_addr=advertised_store(host), store_port=int(os.environ["MASTER_PORT"]),
                checkpoint_transport=TensorsOnlyTransport(host, timeout, self._vet_peer_state),
                # torchft retries a failed lighthouse call with a fresh connection (a restarted lighthouse), once
                # about every second within the quorum timeout; 0 (its default) left the quorum hanging to it
                quorum_retries=max(1, int(ft.quorum_timeout_s)),
            )
        self.healed = False  # set by torchft's recovery during a quorum
        self.replica_pg = ctx.world_pg  # this replica's own ranks (its job: parallelism.dp = 1)
        self.hetero = next((h for h in self.hooks if isinstance(h, HeteroHook)), None)
        self._fixed_from_peer = False  # T_fixed taken in a heal: a compressed pipeline's later stages take stage 0's
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
        # kept over the attempts: a rank healed in a failed attempt is at the quorum's step in the retry (torchft does
        # not heal it again), holds the global weights and joins without a payload (its delta would be zero)
        self.healed = False
        split = None
        for attempt in range(self.ft.max_retries + 1):
            self._quorum()  # synchronous: a replica behind the quorum is healed here (_load_peer_state)
            split = self._heal_split()  # collective over this replica's ranks
            error = [e.clone() for e in self.error]  # error feedback changes only with a committed sync
            payloads = None
            # torchft reports a failed reconfigure or heal (e.g. the peer's checkpoint server answering HTTP 500
            # after a lighthouse restart) and returns with its process group unconfigured, whose size() then
            # asserts: nothing may touch the group, the vote below fails and the next quorum retries the heal
            if self.manager.errored() is None:
                self.ledger.record("quorum", 0, self.pg)
                payloads = self._gather(send and not self.healed, error)
                self.ledger.record("commit", 0, self.pg)
            if split is not None:  # after the gather (the other replicas are not left waiting in it): the vote fails
                self.manager.report_error(RuntimeError(split))
            if self.manager.should_commit():
                self.error = error
                self.attempts.append(attempt + 1)
                self._share_fixed_over_pipeline()
                senders = [p[1:] for p in payloads if p[0] == SENDS] if payloads is not None else []
                if senders:
                    self._apply(senders)
                elif self.healed:
                    self.outer.load_into(self.params)
                return
            if attempt < self.ft.max_retries:  # said, not silent: a peer died mid-sync, or a heal was refused
                error = self.manager.errored()
                self._say(f"sparseloco.fault_tolerance: replica {self.replica}: outer sync {self.outer.syncs + 1} "
                          f"attempt {attempt + 1} failed ({_first_line(getattr(error, 'original_exception', error))}); "
                          f"retrying with the next quorum")
        raise self._failed(split)

    def _failed(self, split: Optional[str]) -> TrainingError:
        """The run's end after max_retries failed attempts; a split heal is named alike on every rank of the replica
        (the vote's own error, and the sync count, may differ rank by rank)."""
        if split is not None:
            return TrainingError(f"sparseloco.fault_tolerance: {split}; still so after {self.ft.max_retries + 1} "
                                 f"attempts (sparseloco.fault_tolerance.max_retries={self.ft.max_retries})")
        error = self.manager.errored()
        return TrainingError(f"sparseloco.fault_tolerance: outer sync {self.outer.syncs + 1} failed "
                             f"{self.ft.max_retries + 1} times (sparseloco.fault_tolerance.max_retries="
                             f"{self.ft.max_retries}); last error: {getattr(error, 'original_exception', error)}")

    def _heal_split(self) -> Optional[str]:
        """Collective over this replica's own ranks, after a quorum: None when they hold the same outer sync (all
        healed to it, or none behind), else a line naming the ranks on each side. torchft heals and votes per rank,
        each rank from its peer rank's server; a peer exiting mid-transfer can heal some ranks only. Those cannot go
        back (their state was overwritten), so the attempt fails on every rank and is retried: the ranks not healed
        are behind that quorum's step and heal from a peer then; with no peer left to heal from, the run ends (and
        restarts from its checkpoint) rather than train a model whose shards come from different outer syncs.
        Compared: the sync count, not whether a rank healed (torchft's step-0 heal takes each rank's state from any
        replica, the serving one not healing). One int64 all_gather per quorum."""
        group = self.replica_pg
        if group is None or group.size() == 1:
            return None
        mine = torch.tensor([self.outer.syncs, int(self.healed)], dtype=torch.int64, device=self.global_device)
        seen = [torch.empty_like(mine) for _ in range(group.size())]
        with self.ledger.tag("heal"):
            dist.all_gather(seen, mine, group=group)
        ranks: Dict[Tuple[int, int], List[int]] = {}
        for rank, t in enumerate(seen):
            syncs, healed = t.tolist()
            ranks.setdefault((syncs, healed), []).append(rank)
        if len({syncs for syncs, _ in ranks}) == 1:
            return None
        sides = "; ".join(f"ranks {', '.join(map(str, r))} {'healed to' if healed else 'at'} outer sync {syncs}"
                          for (syncs, healed), r in sorted(ranks.items(), reverse=True))
        return (f"replica {self.replica}: a heal reached only some of its ranks ({sides}), so none of them commits "
                f"(a retry heals the others from a live peer; with none left, restart from the checkpoint)")

    def _quorum(self) -> None:
        """torchft's quorum, the lighthouse watched: a lighthouse that does not answer is waited for (bounded,
        said with its address); one that stays away ends the run with what to do (rows 12, 15)."""
        self.lighthouse.wait()
        with self.lighthouse.during():
            try:
                self.manager.start_quorum()
            except TimeoutError as e:  # torchft's "Timeout expired" (an OSError: not a disk fault)
                reason = unreachable(self.ft.lighthouse)
                if reason is not None:
                    raise gone(self.ft.lighthouse, reason, self.ft.quorum_timeout_s) from None
                raise TrainingError(
                    f"sparseloco.fault_tolerance: no quorum within sparseloco.fault_tolerance.quorum_timeout_s="
                    f"{self.ft.quorum_timeout_s:g} s although the torchft lighthouse at {self.ft.lighthouse} answers: "
                    f"fewer than sparseloco.fault_tolerance.min_replicas={self.ft.min_replicas} replicas joined "
                    f"[{e}]") from None

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

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

        try:  # size() too: an unconfigured torchft group asserts there
            gathered = [torch.empty_like(payload) for _ in range(self.pg.size())]
            self.pg.allgather([gathered], [payload], AllgatherOptions()).wait()
        except Exception as e:  # noqa: BLE001 - a dead peer: torchft's vote turns it into a retry
            self.manager.report_error(e)
            return None
        self.ledger.record("all_gather", payload.numel(), self.pg)
        return gathered

    def _share_fixed_over_pipeline(self) -> None:
        """After a committed heal: T_fixed, taken from the peer's rank of the same stage, is right on the
        embedding's stage (every replica folds it there), but a plain peer's later stages never fold it; a
        compressed pipeline's later stages decode with it, so they take stage 0's (as at start, hetero.HeteroHook).
        torchft heals rank by rank (at step 0 a pipeline's stages may take different replicas' states), so the
        stages first agree whether any of them healed: one 8-byte pp all_reduce per committed sync."""
        healed, self._fixed_from_peer = self._fixed_from_peer, False
        h = self.hetero
        pp = h.pp_pg if h is not None else None
        if pp is None or pp.size() == 1 or self.replica not in self.scfg.compressed_replicas:
            return
        fixed = h.hubs[self.replica].fixed
        any_healed = torch.tensor([int(healed)], dtype=torch.int64, device=fixed.device)
        with self.ledger.tag(FOLD_TAG):
            dist.all_reduce(any_healed, op=dist.ReduceOp.MAX, group=pp)
            if int(any_healed.item()):
                dist.broadcast(fixed, src=dist.get_global_rank(pp, 0), group=pp)

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
        if self.hetero is not None:  # heterogeneous: T_fixed, equal on every replica after each sync (sec. 2.4)
            state["fixed"] = [self.hetero.hubs[self.replica].fixed]
        self.ledger.record("send:recovery", _nbytes(state["global"] + state["momentum"] + state.get("fixed", [])),
                           self.pg)
        return state

    def _vet_peer_state(self, state: Dict[str, Any], step: int, source: str) -> None:
        """Before torchft applies a healing state (it arrived unpickled with weights_only): refuse one this run
        could not have produced (ft_peer.peer_state_problem), naming the peer."""
        from nanotron_ext.sparseloco.ft_peer import PeerRefused, peer_state_problem

        o = self.outer
        fixed = [self.hetero.hubs[self.replica].fixed] if self.hetero is not None else None
        problem = peer_state_problem(state, step, [(g.shape, g.dtype) for g in o.global_params], bool(o.momentum),
                                     self.max_syncs, [(f.shape, f.dtype) for f in fixed] if fixed else None)
        if problem:
            raise PeerRefused(f"refused to heal from the peer at {source} (quorum step {step}): {problem}")
        self._heal_source = source  # said by every rank once applied (each heals from its peer rank's server)

    @torch.no_grad()
    def _load_peer_state(self, state: Dict[str, Any]) -> None:
        o = self.outer
        for dst, src in zip(o.global_params + o.momentum, state["global"] + state["momentum"]):
            dst.copy_(src)
        o.syncs = int(state["syncs"])
        if self.hetero is not None:  # the codec's state: T_fixed as the peer holds it; U is rebuilt from its seed
            self.hetero.hubs[self.replica].fixed.copy_(state["fixed"][0])
            self._fixed_from_peer = True
        for e in self.error:
            e.zero_()
        o.load_into(self.params)
        self.healed = True
        self._say(f"sparseloco.fault_tolerance: replica {self.replica} took the global weights and outer state of "
                  f"outer sync {o.syncs} from a live peer")
        nbytes = _nbytes(state["global"] + state["momentum"] + state.get("fixed", []))
        self.ledger.record("recv:recovery", nbytes, self.pg)
        print(f"sparseloco.fault_tolerance: replica {self.replica} rank {self.manager._group_rank} healed from "
              f"{getattr(self, '_heal_source', '?')}: {nbytes} bytes", file=sys.stderr, flush=True)
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


def _first_line(error: object) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _nbytes(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
