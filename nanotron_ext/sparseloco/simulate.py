"""Simulated replicas: M SparseLoCo replicas run one after another in one process, so sweeps over
M, k, H fit on a laptop's cores. The outer step is `SparseLoCoOuter`'s, exactly as in the
distributed mode: each replica encodes its payload (the bytes it would send), the payloads are
aggregated in replica order, and every replica takes the global weights; only the all_gather is
replaced by a Python list (tests/test_sparseloco_outer.py checks bit equality with dp=2).
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Dict, List, Literal, Optional, Sequence

import torch
from torch import nn

from nanotron_ext.config.schema import Config, ConfigError, SparseLoCoConfig
from nanotron_ext.sparseloco.outer import ReplicaHook, SparseLoCoOuter


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
        self.outer.apply(payloads)
        for hook in self.hooks:
            hook(-1, self.outer.global_params, "after_apply")
        for r, ps in enumerate(self.params):
            self.outer.load_into(ps)
            for hook in self.hooks:
                hook(r, ps, "after_sync")


def run_simulated(cfg: Config, replicas: int, mode: Literal["sparseloco", "dense"] = "sparseloco",
                  config_file: Optional[str] = None) -> Dict[str, Any]:
    """Train `replicas` data-parallel replicas of `cfg`'s model in this process (a 1-rank process group),
    each on the data shard the trainer would give DP rank r of `replicas`, with the trainer's inner step
    (clip, optimiser, scheduler, model hook). mode "sparseloco": `SimulatedReplicas` every H steps;
    "dense": gradients averaged over the replicas every step (classic DP). Returns per-step mean train
    loss, final validation loss (replica 0, identical to all after a sync), bytes per replica per sync
    and the replicas' final weights."""
    from nanotron_ext.data.loader import build_train_loader, build_validation_loader
    from nanotron_ext.models.build import build_model, replica_config
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.optim.clip import clip_grad_norm_
    from nanotron_ext.optim.lr_schedule import build_scheduler
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import evaluate, forward_backward, make_engine

    if mode == "dense" and cfg.sparseloco.grassmann_every:  # its updates run at outer syncs: there are none
        raise ConfigError(f"sparseloco.grassmann_every={cfg.sparseloco.grassmann_every}: Grassmann updates run at "
                          "SparseLoCo outer syncs; the dense mode (gradients averaged every step) has none, set it to 0")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # general.backend as the trainer reads it: auto = NCCL on CUDA (the replicas then train on the GPU)
    ctx = build_parallel_context(1, 1, 1, backend=None if cfg.general.backend == "auto" else cfg.general.backend)
    engine = make_engine(cfg.parallelism.pp_engine)
    models, opts, scheds, loaders = [], [], [], []
    for r in range(replicas):
        torch.manual_seed(cfg.general.seed)  # as the trainer: every replica builds the same weights
        models.append(build_model(replica_config(cfg, r), ctx))  # heterogeneous: a per-replica codec
        opts.append(build_optimizer(models[-1], cfg.optimizer, ctx.tp_pg))
        scheds.append(build_scheduler(opts[-1], cfg.optimizer, cfg.tokens.train_steps))
        loaders.append(build_train_loader(cfg, dp_rank=r, dp_size=replicas, config_file=config_file))
    sim = SimulatedReplicas(models, cfg.sparseloco) if mode == "sparseloco" else None
    if cfg.sparseloco.compressed_replicas:  # after SimulatedReplicas copied replica 0's weights, as the broadcast
        from nanotron_ext.sparseloco.hetero import hetero_hook
        if sim is None:  # dense mode: a compressed replica 0 projected its output weights; all start from them
            with torch.no_grad():
                for m in models[1:]:
                    for p, p0 in zip(trainable(m), trainable(models[0])):
                        p.copy_(p0)
        hook = hetero_hook(cfg, dict(enumerate(models)), syncs=lambda: sim.outer.syncs)
        if sim is not None:
            sim.outer = SparseLoCoOuter(sim.params[0], cfg.sparseloco, sim.names)  # global weights after the split
            sim.hooks.append(hook)
    losses: List[float] = []
    for step in range(1, cfg.tokens.train_steps + 1):
        step_losses = []
        for r, model in enumerate(models):
            micro = [next(loaders[r]) for _ in range(cfg.tokens.batch_accumulation_per_replica)]
            step_losses.append(forward_backward(model, engine, micro, ctx).item())
        if mode == "dense":  # sum in replica order, then divide: what the gloo all-reduce of two computes
            for ps in zip(*(trainable(m) for m in models)):
                mean = sum((p.grad for p in ps[1:]), ps[0].grad.clone()) / replicas
                for p in ps:
                    p.grad.copy_(mean)
        for model, opt, sched in zip(models, opts, scheds):
            clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad, ctx.tp_pg, ctx.pp_pg)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            model.after_optimizer_step()
        if sim is not None:
            sim.after_step(step)
        losses.append(sum(step_losses) / replicas)
    val_loader = build_validation_loader(cfg, dp_rank=0, dp_size=replicas, config_file=config_file)
    batches = list(itertools.islice(val_loader, cfg.tokens.val_steps))
    n = cfg.tokens.batch_accumulation_per_replica
    val = [evaluate(models[0], engine, batches[i:i + n], ctx).item() for i in range(0, len(batches), n)]
    return {"train_loss": losses, "val_loss": sum(val) / len(val), "sync_bytes": sim.sent_bytes if sim else [],
            "weights": [{n_: p.detach().clone() for n_, p in m.named_parameters()} for m in models], "models": models}
