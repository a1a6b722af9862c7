"""Simulated replicas: M SparseLoCo replicas run one after another in one process, so sweeps over
M, k, H fit on a laptop's cores. The outer step is `SparseLoCoOuter`'s, exactly as in the
distributed mode: each replica encodes its payload (the bytes it would send), the payloads are
aggregated in replica order, and every replica takes the global weights; only the all_gather is
replaced by a Python list (tests/test_sparseloco_outer.py checks bit equality with dp=2).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import torch
from torch import nn

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.config.schema import Config
from nanotron_ext.data.loader import build_train_loader, build_validation_loader
from nanotron_ext.parallel.context import standalone_context
from nanotron_ext.sparseloco.config import SparseLoCoConfig
from nanotron_ext.sparseloco.hetero import hetero_hook
from nanotron_ext.sparseloco.outer import ReplicaHook, SparseLoCoOuter
from nanotron_ext.train.replica import Replica, validation_summary


def trainable(model: nn.Module) -> List[torch.nn.Parameter]:
    """The parameters SparseLoCo synchronises, in the order SparseLoCoSync uses (named_parameters)."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


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

    def after_step(self, step: int) -> None:
        """Call once every replica has taken inner step `step` (1-based)."""
        if step % self.cfg.inner_steps == 0:
            self.sync()

    def sync(self) -> None:
        payloads = []
        for r, (ps, e) in enumerate(zip(self.params, self.errors)):
            for hook in self.hooks:
                hook(r, ps, "before_encode")
            payloads.append(self.outer.encode(ps, e))
        self.sent_bytes.append(payloads[0].numel())
        self.outer.drop_absent(payloads, dict(enumerate(self.errors)))
        self.outer.apply(payloads)
        for hook in self.hooks:
            hook(-1, self.outer.global_params, "after_apply")
        for r, ps in enumerate(self.params):
            self.outer.load_into(ps)
            for hook in self.hooks:
                hook(r, ps, "after_sync")


def run_simulated(cfg: Config, replicas: int, mode: Literal["sparseloco", "dense"] = "sparseloco",
                  config_file: Optional[str] = None,
                  observe: Optional[Callable[[List[Replica]], ReplicaHook]] = None,
                  val_every: int = 0) -> Dict[str, Any]:
    """Train `replicas` data-parallel replicas of `cfg`'s model in this process (a 1-rank process group),
    each on the data shard the trainer gives DP rank r of `replicas`, each taking the trainer's own step
    (nanotron_ext.train.replica.Replica: autocast, clipping, the non-finite guard, optimiser, schedule,
    constraint hooks). mode "sparseloco": `SimulatedReplicas` every H steps; "dense": gradients averaged
    over the replicas every step (classic DP). Losses are averaged over the replicas in replica order, as
    the trainer's DP all-reduce does (bit-identical to the trainer at dp = 2). Returns per-step mean train
    loss, the final validation loss (each replica on its own validation shard, averaged, as the trainer
    does), bytes per replica per sync and the replicas' final weights. `observe(replicas)` returns a hook that
    sees every outer sync as SimulatedReplicas' own hooks do (it must not change the weights). `val_every` > 0 also
    validates after every `val_every` steps ("val_curve": [[step, val_loss]], the last step's included)."""
    if mode == "dense" and cfg.sparseloco.grassmann_every:  # its updates run at outer syncs: there are none
        raise ConfigError(f"sparseloco.grassmann_every={cfg.sparseloco.grassmann_every}: Grassmann updates run at "
                          "SparseLoCo outer syncs; the dense mode (gradients averaged every step) has none, "
                          "set it to 0")
    # general.backend as the trainer reads it: auto = NCCL on CUDA (the replicas then train on the GPU)
    ctx = standalone_context(backend=None if cfg.general.backend == "auto" else cfg.general.backend)
    reps = [Replica(cfg, ctx, r, local=True) for r in range(replicas)]  # heterogeneous: a per-replica codec
    models = [rep.model for rep in reps]
    loaders = [build_train_loader(cfg, dp_rank=r, dp_size=replicas, config_file=config_file) for r in range(replicas)]
    sim = _outer_loop(cfg, models, mode)
    if sim is not None and observe is not None:
        sim.hooks.append(observe(reps))
    losses: List[float] = []
    curve: List[List[float]] = []
    for step in range(1, cfg.tokens.train_steps + 1):
        step_losses = [rep.backward([next(loaders[r]) for _ in range(cfg.tokens.batch_accumulation_per_replica)])
                       for r, rep in enumerate(reps)]
        loss = replica_mean(step_losses).item()
        if mode == "dense":
            average_gradients(models)
        for rep in reps:
            rep.update(step, loss)
        if sim is not None:
            sim.after_step(step)
        losses.append(loss)
        if val_every and step % val_every == 0 and step < cfg.tokens.train_steps:
            curve.append([step, validate(cfg, reps, config_file)])
    val = validate(cfg, reps, config_file)
    curve.append([cfg.tokens.train_steps, val])
    return {"train_loss": losses, "val_loss": val, "val_curve": curve, "sync_bytes": sim.sent_bytes if sim else [],
            "weights": [{n_: p.detach().clone() for n_, p in m.named_parameters()} for m in models], "models": models}


def _outer_loop(cfg: Config, models: List[nn.Module], mode: str) -> Optional[SimulatedReplicas]:
    """SparseLoCo's outer loop over the models (None in the dense mode), with heterogeneous SparseLoCo's
    embedding adaptation hooked in where replicas are compressed."""
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
    return sim


def average_gradients(models: Sequence[nn.Module]) -> None:
    """Every replica's gradients replaced by their mean in replica order (classic DP, as the trainer's all-reduce)."""
    for ps in zip(*(trainable(m) for m in models)):
        mean = replica_mean([p.grad for p in ps])
        for p in ps:
            p.grad.copy_(mean)


def validate(cfg: Config, reps: Sequence[Replica], config_file: Optional[str] = None) -> float:
    """The validation loss the trainer reports: each replica on its own validation shard (its first val_steps
    batches, as every validation), the groups averaged over the replicas in replica order."""
    groups = []
    for r, rep in enumerate(reps):
        val_loader = build_validation_loader(cfg, dp_rank=r, dp_size=len(reps), config_file=config_file)
        groups.append(rep.validation_losses(list(itertools.islice(val_loader, cfg.tokens.val_steps))))
    return validation_summary([replica_mean(list(g)).item() for g in zip(*groups)])["val_loss"]


def replica_mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in replica order, then divide: what the trainer's gloo all-reduce of two replicas computes."""
    return sum(values[1:], values[0].clone()) / len(values)
