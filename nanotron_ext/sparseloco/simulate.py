"""Simulated replicas: M SparseLoCo replicas run one after another in one process (the core's
nanotron_ext.train.simulated runner), so sweeps over M, k, H fit on a laptop's cores. The outer step is
`SparseLoCoOuter`'s, exactly as in the distributed mode: each replica encodes its payload (the bytes it would
send), the payloads are aggregated in replica order, and every replica takes the global weights; only the
all_gather is replaced by a Python list (tests/test_sparseloco_outer.py checks bit equality with dp=2).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import torch
from torch import nn

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.config.schema import Config
from nanotron_ext.sparseloco.config import SparseLoCoConfig
from nanotron_ext.sparseloco.hetero import hetero_hook
from nanotron_ext.sparseloco.outer import ReplicaHook, SparseLoCoOuter
from nanotron_ext.sparseloco.streaming import merge_
from nanotron_ext.train.replica import Replica
from nanotron_ext.train.simulated import run_replicas, trainable


class SimulatedReplicas:
    """Outer loop over M in-process replicas (one model and one inner optimiser each, kept by the caller)."""

    def __init__(self, models: Sequence[nn.Module], cfg: SparseLoCoConfig) -> None:
        self.cfg = cfg
        self.params = [trainable(m) for m in models]
        with torch.no_grad():  # replicas start from replica 0's weights, as the distributed broadcast does
            for ps in self.params[1:]:
                for p, p0 in zip(ps, self.params[0]):
                    p.copy_(p0)
        self.names = [n for n, p in models[0].named_parameters() if p.requires_grad]
        self.outer = SparseLoCoOuter(self.params[0], cfg, self.names)
        print(self.outer.report_density(), flush=True)
        self.errors = [self.outer.new_error() for _ in models]
        self.sent_bytes: List[int] = []  # per sync: bytes each replica would send (its payload)
        self.hooks: List[ReplicaHook] = []
        self.pending: Optional[List[torch.Tensor]] = None  # streaming: the payloads sent, not yet applied

    def after_step(self, step: int) -> None:
        """Call once every replica has taken inner step `step` (1-based). With sparseloco.streaming.delay = tau > 0
        the payloads sent at a multiple of H are applied (and merged) tau steps later, as the distributed
        streaming.StreamingSparseLoCoSync does."""
        h, tau = self.cfg.inner_steps, self.cfg.streaming.delay
        if tau and step % h == tau and self.pending is not None:
            self.arrive(self.pending)
            self.pending = None
        if step % h == 0:
            if tau:
                self.pending = self.send()
            else:
                self.sync()

    def sync(self) -> None:
        self.arrive(self.send())

    def send(self) -> List[torch.Tensor]:
        """Every replica's payload (updating its error feedback), in replica order."""
        payloads = []
        for r, (ps, e) in enumerate(zip(self.params, self.errors)):
            for hook in self.hooks:
                hook(r, ps, "before_encode")
            payloads.append(self.outer.encode(ps, e))
        absent = self.outer.absent(len(self.params))
        if self.cfg.streaming.delay and absent is not None:  # emulated churn: it rejoins now, healed (streaming.py)
            self.outer.load_into(self.params[absent])
        self.sent_bytes.append(payloads[0].numel())
        return payloads

    def arrive(self, payloads: List[torch.Tensor]) -> None:
        """The outer step from `payloads`; every replica takes the global weights (streaming: merges them)."""
        self.outer.drop_absent(payloads, dict(enumerate(self.errors)))
        self.outer.apply(payloads)
        for hook in self.hooks:
            hook(-1, self.outer.global_params, "after_apply")
        for r, ps in enumerate(self.params):
            if self.cfg.streaming.delay:
                merge_(ps, self.outer.global_params, self.cfg.streaming.alpha)
            else:
                self.outer.load_into(ps)
            for hook in self.hooks:
                hook(r, ps, "after_sync")


def run_simulated(cfg: Config, replicas: int, mode: Literal["sparseloco", "dense"] = "sparseloco",
                  config_file: Optional[str] = None,
                  observe: Optional[Callable[[List[Replica]], ReplicaHook]] = None,
                  val_every: int = 0) -> Dict[str, Any]:
    """Train `replicas` data-parallel replicas of `cfg`'s model in this process (nanotron_ext.train.simulated:
    each on its DP rank's data shard, each taking the trainer's own step). mode "sparseloco": `SimulatedReplicas`
    every H steps; "dense": gradients averaged over the replicas every step (classic DP, also for a config whose
    dp_sync is sparseloco: its heterogeneous replicas then start from replica 0's projected weights). Returns
    run_replicas' result (per-step mean train loss, final validation loss, `val_every` > 0: the curve, bytes per
    replica per sync, final weights). `observe(replicas)` returns a hook that sees every outer sync as
    SimulatedReplicas' own hooks do (it must not change the weights)."""
    if mode == "dense" and cfg.sparseloco.grassmann_every:  # its updates run at outer syncs: there are none
        raise ConfigError(f"sparseloco.grassmann_every={cfg.sparseloco.grassmann_every}: Grassmann updates run at "
                          "SparseLoCo outer syncs; the dense mode (gradients averaged every step) has none, "
                          "set it to 0")
    return run_replicas(cfg, replicas, config_file, val_every,
                        outer=lambda c, reps: outer_loop(c, reps, mode, observe))


def outer_loop(cfg: Config, reps: List[Replica], mode: str = "sparseloco",
               observe: Optional[Callable[[List[Replica]], ReplicaHook]] = None) -> Optional[SimulatedReplicas]:
    """SparseLoCo's outer loop over in-process replicas (`Technique.simulated`; None in the dense mode), with
    heterogeneous SparseLoCo's embedding adaptation hooked in where replicas are compressed."""
    models = [rep.model for rep in reps]
    sim = SimulatedReplicas(models, cfg.sparseloco) if mode == "sparseloco" else None
    if cfg.sparseloco.compressed_replicas:  # after SimulatedReplicas copied replica 0's weights, as the broadcast
        if sim is None:  # dense mode: a compressed replica 0 projected its output weights; all start from them
            with torch.no_grad():
                for m in models[1:]:
                    for p, p0 in zip(trainable(m), trainable(models[0])):
                        p.copy_(p0)
        hook = hetero_hook(cfg, dict(enumerate(models)), syncs=lambda: sim.outer.syncs)
        if sim is not None:
            sim.outer = SparseLoCoOuter(sim.params[0], cfg.sparseloco, sim.names)  # global weights after the split
            sim.hooks.append(hook)
    if sim is not None and observe is not None:
        sim.hooks.append(observe(reps))
    return sim
