"""Learning-rate schedule: linear warm-up, then cosine / linear / constant to `min_lr_ratio`.

The schedule is a multiplier on each parameter group's own peak (`initial_lr`), so one
`LambdaLR` drives the Muon group (peak `muon_lr`) and the AdamW groups (peak `lr`) together; the
Muon group decays to `muon_min_lr_ratio` when it is set, the others to `min_lr_ratio`.

Step convention (0-based optimiser steps, `total_steps` of them, the last being `total_steps-1`):

* warm-up, steps 0 .. W-1: (step + 1) / W, so step 0 already trains at peak / W instead of
  wasting a step at lr 0, and step W-1 reaches the peak;
* decay, steps W .. T-1: starts at 1.0 at step W and reaches exactly `min_lr_ratio` at T-1
  (progress = (step - W) / (T - 1 - W)); steps past T-1 stay at `min_lr_ratio`;
* constant: 1.0 after warm-up.

When warm-up covers every step (W >= T) the run ends at the top of warm-up: there is no decay
step left to reach `min_lr_ratio` on.
"""
from __future__ import annotations

import functools
import math

import torch

from nanotron_ext.config.schema import OptimizerConfig

_DECAYS = ("cosine", "linear", "constant")


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """The multiplier of the peak learning rate at 0-based optimiser step `step` (see module doc)."""
    if decay not in _DECAYS:
        raise ValueError(f"decay must be one of {_DECAYS}, got {decay!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = total_steps - 1 - warmup_steps
    # span <= 0: the first step after warm-up is already the last one, so it gets the floor.
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int, last_epoch: int = -1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_lambda` to every group's own peak lr.

    Call `scheduler.step()` after each `optimizer.step()`; the lr used by step k is then
    peak * lr_lambda(k). A `functools.partial` (not a closure) keeps the scheduler picklable.
    To resume, build it on the fresh optimizer, then load both state dicts.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    def fn(min_lr_ratio: float) -> functools.partial:
        return functools.partial(lr_lambda, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                                 decay=cfg.decay, min_lr_ratio=min_lr_ratio)

    # the Muon group may end at its own floor (optimizer.muon_min_lr_ratio); one lambda per group
    muon_floor = cfg.min_lr_ratio if cfg.muon_min_lr_ratio is None else cfg.muon_min_lr_ratio
    fns = [fn(muon_floor if g.get("name") == "muon" else cfg.min_lr_ratio) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fns, last_epoch=last_epoch)
