"""A refused optimizer step skipped on the device, without the host reading the verdict.

torch's fused Adam / AdamW take a `found_inf` tensor (GradScaler's path; torch/optim/adam.py `_fused_adam`): where it
holds 1.0 the kernel returns before touching parameters and moments, and the step counters it raised are lowered
again by the same amount, so the optimizer's state is as before the call. The host never reads the flag. The
for-loop and foreach AdamW assert that it is unset, and Muon, SPEL and the techniques' optimizers have no such
input: with any of those the trainer reads its verdict on the host before the step (nanotron_ext.train.step_guard).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

from nanotron_ext.optim.build import ChainedOptimizer


def _children(optimizer: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
    return list(optimizer.optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    # the exact classes: a subclass may override step() and never read found_inf
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and all(g.get("fused") and not g.get("differentiable") for g in optimizer.param_groups))


def host_only(optimizer: torch.optim.Optimizer) -> List[str]:
    """The optimizers in `optimizer` (a ChainedOptimizer's children) that cannot skip a step on the device, by
    name (e.g. "TensorParallelMuon", "AdamW (not fused)"); empty when every one can."""
    out = []
    for o in _children(optimizer):
        if not _skips_on_device(o):
            name = type(o).__name__
            out.append(f"{name} (not fused)" if type(o) in (torch.optim.Adam, torch.optim.AdamW) else name)
    return out


@contextlib.contextmanager
def skipped_where(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> Iterator[None]:
    """Within, `optimizer.step()` leaves every parameter, moment and step count as it was when `flag` (a float32
    0-d tensor on the parameters' device holding 0.0 or 1.0; the kernels test == 1) is 1. Only for an optimizer
    whose `host_only` is empty."""
    children = _children(optimizer)
    for o in children:
        o.found_inf = flag  # type: ignore[attr-defined]  (read by Adam.step, as GradScaler sets it)
    try:
        yield
    finally:
        for o in children:
            del o.found_inf  # type: ignore[attr-defined]
