"""M data-parallel replicas in one process (a 1-rank process group), each taking the trainer's own step
(nanotron_ext.train.replica.Replica), so that a DP layout trains on one core with the same math: the WAN
meter's loss runs (bench/wan/losses.py) and the SparseLoCo sweeps (sparseloco.simulate.run_simulated).

Between the replicas' steps there is either an outer loop, which a DP sync's technique builds for in-process
replicas (`Technique.simulated`: SparseLoCo's `SimulatedReplicas` every H steps), or, without one, the core's
all-reduce: every gradient replaced by its mean over the replicas each step. Each replica reads the data shard
the trainer gives DP rank r; losses and validation are averaged over the replicas in replica order, as the
trainer's DP all-reduce does (bit-identical to the trainer at dp = 2: tests/test_sparseloco_outer.py,
tests/test_wan_losses.py).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn

from nanotron_ext.config.schema import Config
from nanotron_ext.data.loader import build_train_loader, build_validation_loader
from nanotron_ext.parallel.context import standalone_context
from nanotron_ext.train.replica import Replica, validation_summary


class OuterLoop(Protocol):
    """What a DP sync's in-process outer loop gives the runner."""

    sent_bytes: List[int]  # per sync: the bytes one replica would send

    def after_step(self, step: int) -> None:
        """Called once every replica has taken inner step `step` (1-based)."""


OuterFactory = Callable[[Config, List[Replica]], Optional[OuterLoop]]


def trainable(model: nn.Module) -> List[torch.nn.Parameter]:
    """The parameters a DP sync synchronises, in named_parameters order."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


def replica_mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in replica order, then divide: what the trainer's gloo all-reduce of two replicas computes."""
    return sum(values[1:], values[0].clone()) / len(values)


def average_gradients(models: Sequence[nn.Module]) -> None:
    """Every replica's gradients replaced by their mean in replica order (the core's per-step all-reduce)."""
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


def dp_sync_outer(cfg: Config, reps: List[Replica]) -> Optional[OuterLoop]:
    """The outer loop `parallelism.dp_sync`'s technique builds for in-process replicas (None: a per-step
    gradient average)."""
    from nanotron_ext.registry import DP_SYNCS
    from nanotron_ext.technique import load_object

    target = DP_SYNCS.owner(cfg.parallelism.dp_sync).simulated
    return load_object(target)(cfg, reps) if target else None


def run_replicas(cfg: Config, replicas: int, config_file: Optional[str] = None, val_every: int = 0,
                 outer: OuterFactory = dp_sync_outer, stop_after: Optional[int] = None) -> Dict[str, Any]:
    """Train `replicas` replicas of `cfg` in this process (the module docstring); `outer(cfg, replicas)` builds
    the outer loop, or returns None for a per-step gradient average. Returns the per-step mean train loss, the
    final validation loss, with `val_every` > 0 a curve [[step, val_loss]] (the last step's included), the bytes
    per replica per sync and the replicas' final weights."""
    # general.backend as the trainer reads it: auto = NCCL on CUDA (the replicas then train on the GPU)
    ctx = standalone_context(backend=None if cfg.general.backend == "auto" else cfg.general.backend)
    reps = [Replica(cfg, ctx, r, local=True) for r in range(replicas)]  # a DP sync may give each its own codec
    models = [rep.model for rep in reps]
    loaders = [build_train_loader(cfg, dp_rank=r, dp_size=replicas, config_file=config_file) for r in range(replicas)]
    loop = outer(cfg, reps)
    losses: List[float] = []
    curve: List[List[float]] = []
    last = min(cfg.tokens.train_steps, stop_after or cfg.tokens.train_steps)  # stop_after: the schedule's first steps
    for step in range(1, last + 1):
        step_losses = [rep.backward([next(loaders[r]) for _ in range(cfg.tokens.batch_accumulation_per_replica)])
                       for r, rep in enumerate(reps)]
        loss = replica_mean(step_losses).item()
        if loop is None:
            average_gradients(models)
        for rep in reps:
            rep.update(step, loss)
        if loop is not None:
            loop.after_step(step)
        losses.append(loss)
        if val_every and step % val_every == 0 and step < last:
            curve.append([step, validate(cfg, reps, config_file)])
    val = validate(cfg, reps, config_file)
    curve.append([last, val])
    return {"train_loss": losses, "val_loss": val, "val_curve": curve, "sync_bytes": loop.sent_bytes if loop else [],
            "weights": [{n_: p.detach().clone() for n_, p in m.named_parameters()} for m in models], "models": models}
