"""SparseLoCo's outer loop ("Heterogeneous Low-Bandwidth Pre-Training of LLMs", sec. 2, Algorithm 1):
every H inner steps each replica sends its compressed pseudo-gradient, all replicas average what
was sent and take one outer SGD step from the shared global weights.

`SparseLoCoOuter` holds the math without communication (global weights, outer momentum, chunk
specs; encode one replica's payload; aggregate payloads; outer step). Two drivers share it:
- `SparseLoCoSync` (parallelism.dp_sync = sparseloco): one replica per rank of the DP group, payloads
  exchanged with one all_gather of a uint8 tensor (so the ledger counts every value, index and
  table byte), used by the trainer via parallelism.dp_sync;
- `simulate.SimulatedReplicas`: M replicas one after another in one process.
Because both decode the same bytes in the same replica order with the same ops, every replica
(and both modes) ends each sync with bit-identical weights.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from torch import nn

from nanotron_ext.parallel.data_parallel import DataParallelSync
from nanotron_ext.sparseloco.compress import (
    ChunkSpec,
    chunk_spec,
    compress_with_feedback_,
    decode_payload,
    density_warning,
    encode_payload,
    from_chunks,
    payload_nbytes,
)
from nanotron_ext.sparseloco.config import SparseLoCoConfig
from nanotron_ext.sparseloco.hetero import hetero_hook

logger = logging.getLogger(__name__)


class SparseLoCoOuter:
    """Outer-loop state shared by all replicas (global weights, momentum) and the outer step's math."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: SparseLoCoConfig,
                 names: Optional[Sequence[str]] = None) -> None:
        self.cfg = cfg
        self.specs: List[ChunkSpec] = [chunk_spec(p.shape, cfg.chunk, cfg.topk) for p in params]
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(self.specs))]
        self.global_params = [p.detach().float().clone() for p in params]
        self.momentum = [torch.zeros_like(g) for g in self.global_params] if cfg.outer_momentum else []
        self.syncs = 0

    def densities(self) -> Dict[str, float]:
        """Effective density (entries sent / elements) of each tensor, by name."""
        return {n: s.density for n, s in zip(self.names, self.specs)}

    def report_density(self) -> str:
        """Log each tensor's effective density, warn when the overall one exceeds twice k / chunk, and return
        a one-line summary (printed by the drivers)."""
        for n, s in zip(self.names, self.specs):
            logger.info("sparseloco chunks of %s %s: %d x %s, density %.3f%%", n, s.shape, s.n_chunks, s.tile,
                        100 * s.density)
        message = density_warning(self.names, self.specs, self.cfg.chunk, self.cfg.topk)
        if message:
            logger.warning(message)
        kept, numel = sum(s.n_kept for s in self.specs), sum(s.numel for s in self.specs)
        densest = max(zip(self.names, self.specs), key=lambda ns: ns[1].density)
        return (f"sparseloco: {len(self.specs)} tensors, {kept:,} of {numel:,} entries per sync ({kept / numel:.2%}; "
                f"k / chunk = {self.cfg.topk / self.cfg.chunk:.2%}); densest {densest[0]} {densest[1].shape} "
                f"{densest[1].density:.2%}")

    def new_error(self) -> List[torch.Tensor]:
        """A fresh error-feedback buffer for one replica (each replica keeps its own)."""
        return [torch.zeros_like(g) for g in self.global_params]

    def payload_nbytes(self) -> int:
        c = self.cfg
        return payload_nbytes(self.specs, c.index_bits, c.quant_bits, c.value_dtype)

    def encode(self, local: Sequence[torch.Tensor], error: Sequence[torch.Tensor]) -> torch.Tensor:
        """One replica's payload: delta = global - local, error feedback, top-k, values (updates `error`)."""
        c = self.cfg
        parts = [compress_with_feedback_(e, g - p.detach().float(), s, c.beta, c.quant_bits, c.value_dtype)
                 for g, p, e, s in zip(self.global_params, local, error, self.specs)]
        payload = encode_payload(parts, self.specs, c.index_bits, c.quant_bits)
        assert payload.numel() == self.payload_nbytes()  # equal sizes: all_gather needs them
        return payload

    def absent(self, replicas: int) -> Optional[int]:
        """The replica that misses the coming sync under emulated churn (sparseloco.churn), or None."""
        c = self.cfg.churn
        if replicas < 2 or self.syncs % c.period >= c.down_syncs:
            return None
        return (self.syncs // c.period) % replicas

    def drop_absent(self, payloads: List[torch.Tensor], errors: Mapping[int, Sequence[torch.Tensor]]) -> Optional[int]:
        """Emulated churn: remove the absent replica's payload from `payloads` (one per replica, in replica order)
        and clear its error feedback if `errors` (replica -> its buffers) holds it: it rejoins with zero."""
        r = self.absent(len(payloads))
        if r is not None:
            payloads.pop(r)
            for e in errors.get(r, ()):
                e.zero_()
            logger.info("sparseloco: replica %d missed outer sync %d (sparseloco.churn)", r, self.syncs + 1)
        return r

    def aggregate(self, payloads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Mean of the replicas' sparse pseudo-gradients, per position over all replicas or over the
        replicas that sent it (`aggregate`); replicas summed in rank order (same bits everywhere)."""
        c = self.cfg
        decoded = [decode_payload(b, self.specs, c.index_bits, c.quant_bits, c.value_dtype) for b in payloads]
        out = []
        for i, spec in enumerate(self.specs):
            device = self.global_params[i].device  # payloads live where the weights do (CUDA under NCCL)
            total = torch.zeros(spec.n_chunks, spec.chunk_size, device=device)
            count = torch.zeros(spec.n_chunks, spec.chunk_size, device=device)
            for replica in decoded:
                idx, val = replica[i]
                total.scatter_add_(1, idx, val)  # indices are distinct within a chunk
                count.scatter_add_(1, idx, torch.ones_like(val))
            mean = total / len(payloads) if c.aggregate == "all" else total / count.clamp(min=1)
            out.append(from_chunks(mean, spec))
        return out

    def apply(self, payloads: Sequence[torch.Tensor]) -> None:
        """Outer SGD on the global weights: g -= lr * (the aggregate, the momentum buffer b = mu b + aggregate, or
        with outer_nesterov aggregate + mu b: torch.optim.SGD's update, dampening 0)."""
        c = self.cfg
        for i, (g, a) in enumerate(zip(self.global_params, self.aggregate(payloads))):
            if self.momentum:
                b = self.momentum[i].mul_(c.outer_momentum).add_(a)
                a = a.add(b, alpha=c.outer_momentum) if c.outer_nesterov else b
            g.sub_(a * c.outer_lr)
        self.syncs += 1

    @torch.no_grad()
    def load_into(self, params: Sequence[torch.Tensor]) -> None:
        for p, g in zip(params, self.global_params):
            p.copy_(g)


ReplicaHook = Callable[[int, Sequence[torch.Tensor], str], None]
"""Hook `(replica, params, moment)` called by both drivers (SparseLoCoSync.hooks, SimulatedReplicas.hooks):
"before_encode" and "after_sync" for each replica with that replica's parameters; "after_apply" once per sync
with the global copies (SparseLoCoOuter.global_params) after the outer step, before any replica takes them
(replica = -1 in the simulated driver); "global_loaded" with the global copies after a checkpoint replaced them.
The heterogeneous variant plugs in here (nanotron_ext.sparseloco.hetero.HeteroHook): embedding adaptation
projects the global T_S at "after_apply" and folds the residual into each replica's T_fixed at "after_sync";
the per-replica pipeline codec is chosen when that replica's model is built (SparseLoCoTechnique.replica_config)."""


class SparseLoCoSync(DataParallelSync):
    """One replica per DP rank; no gradient traffic; one all_gather of a compressed payload every H steps."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Optional[Any] = None) -> None:
        super().__init__(model, ctx, cfg)
        self.scfg: SparseLoCoConfig = cfg.sparseloco if cfg is not None else SparseLoCoConfig()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._start_identical()
        self.hooks: List[ReplicaHook] = []
        if cfg is not None and cfg.sparseloco.compressed_replicas:  # heterogeneous: split the table first
            self.hooks.append(hetero_hook(cfg, {self.replica: model}, ctx.pp_pg, syncs=lambda: self.outer.syncs))
        self.outer = SparseLoCoOuter(self.params, self.scfg, self.names)
        self.error = self.outer.new_error()
        if self.replica == 0:
            print(self.outer.report_density(), flush=True)

    @torch.no_grad()
    def _start_identical(self) -> None:
        # the global weights must agree on every replica: take DP rank 0's (one broadcast, at start-up)
        if self.dp_pg.size() > 1:
            src = dist.get_global_rank(self.dp_pg, 0)
            for p in self.params:
                dist.broadcast(p.data, src=src, group=self.dp_pg)

    @property
    def replica(self) -> int:
        return dist.get_rank(self.dp_pg)

    def after_backward(self) -> None:
        """Inner steps use this replica's own gradients: nothing crosses the DP group."""

    def after_step(self, step: int) -> None:
        if step % self.scfg.inner_steps == 0:
            self.sync()

    def sync(self) -> None:
        """One outer step: encode, all_gather over dp_pg, aggregate, outer SGD, take the global weights."""
        for hook in self.hooks:
            hook(self.replica, self.params, "before_encode")
        payload = self.outer.encode(self.params, self.error)
        gathered = [torch.empty_like(payload) for _ in range(self.dp_pg.size())]
        dist.all_gather(gathered, payload, group=self.dp_pg)
        self.outer.drop_absent(gathered, {self.replica: self.error})
        self.outer.apply(gathered)
        for hook in self.hooks:
            hook(self.replica, self.outer.global_params, "after_apply")
        self.outer.load_into(self.params)
        for hook in self.hooks:
            hook(self.replica, self.params, "after_sync")

    def state_dict(self) -> Dict[str, Any]:
        o = self.outer
        return {"global": dict(zip(self.names, o.global_params)), "error": dict(zip(self.names, self.error)),
                "momentum": dict(zip(self.names, o.momentum)), "syncs": o.syncs}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:  # a checkpoint without outer state (e.g. from dp_sync=allreduce): start from the loaded weights
            self.outer = SparseLoCoOuter(self.params, self.scfg, self.names)
            self.error = self.outer.new_error()
            self._global_loaded()
            return
        if state.get("in_flight") is not None:  # saved by streaming.StreamingSparseLoCoSync mid-sync
            raise ValueError("the checkpoint holds an outer sync in flight (saved with sparseloco.streaming.delay > "
                             "0); resume with the run's sparseloco.streaming.delay")
        missing = set(self.names) - set(state["global"])
        if missing:
            raise ValueError(f"sparseloco checkpoint state lacks parameters {sorted(missing)[:5]}")
        o = self.outer
        for i, n in enumerate(self.names):
            o.global_params[i].copy_(state["global"][n])
            self.error[i].copy_(state["error"][n])
            if o.momentum:
                if n not in state["momentum"]:
                    raise ValueError("sparseloco.outer_momentum > 0 but the checkpoint has no outer momentum")
                o.momentum[i].copy_(state["momentum"][n])
        o.syncs = int(state["syncs"])
        self._global_loaded()

    def _global_loaded(self) -> None:
        for hook in self.hooks:
            hook(self.replica, self.outer.global_params, "global_loaded")
