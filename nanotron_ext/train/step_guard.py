"""The trainer's guard decided on the device, so that a step reads nothing back between its forward and its optimizer
step (general.step_guard: auto, the default where the optimizer can skip a step on the device).

Reading the loss or the gradient norm back (`.item()`, `float(tensor)`) drains the GPU's queue: ~6 ms of an H200
step at 125M (issue 40). Here the checks the host path makes before the optimizer step are device comparisons:

- the loss or the gradient norm is not finite on any rank: the same `control` all-reduce (tagged `control`), whose
  result stays on the device (RankAgreement.control_on_device);
- the weights' norm grew more than general.max_weight_growth times in the last step, against the last norm held
  as a device tensor;
- the loss is more than general.max_loss_ratio times the run's first loss, held as a device tensor.

The verdict (float32 0 or 1) goes to the fused AdamW as `found_inf` (nanotron_ext.optim.skip), which leaves a
refused step's weights and optimizer state untouched. Once a step is refused every later one is refused too
(`halted`), until the host reads the verdict: a step later, or at once before a validation, a checkpoint or the
end of the run (Trainer). The host then replays the host path's checks on the values read back (DivergenceGuard,
the same messages and the same reference state), so the error is today's, naming the refused step; the weights
are those of the step before it.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from nanotron_ext.config.schema import Config
from nanotron_ext.optim.skip import host_only
from nanotron_ext.train.agreement import RankAgreement
from nanotron_ext.train.divergence import DivergenceGuard


class Values(NamedTuple):
    """A step's guard values as read back (floats; the flags 0.0 or 1.0, > 0 when summed over ranks)."""

    stop: float  # the loss or the gradient norm was not finite on some rank
    io_failed: float  # rank 0's write failed (RankAgreement.io_error)
    weights_sq: float  # the squared norm of all weights the step started from, summed over ranks
    loss: float
    grad_norm: float
    refused: float  # the device skipped the step


def guard_path(cfg: Config, optimizer: torch.optim.Optimizer) -> Tuple[bool, str]:
    """(whether the guard decides on the device, the line the run prints at start saying which path and why)."""
    if cfg.general.step_guard == "host":
        return False, ("step guard: on the host (general.step_guard=host): the loss and gradient norm are read back "
                       "before every optimizer step")
    why: List[str] = [f"{name} cannot skip a step on the device" for name in host_only(optimizer)]
    # what acts on the weights after every optimizer step would act after a skipped one too
    if cfg.parallelism.dp_sync != "allreduce":
        why.append(f"parallelism.dp_sync={cfg.parallelism.dp_sync} acts after every optimizer step")
    if cfg.model.output_constraint.kind != "none":
        why.append(f"model.output_constraint.kind={cfg.model.output_constraint.kind} acts after every optimizer step")
    if why:
        return False, (f"step guard: on the host, the loss and gradient norm read back before every optimizer step "
                       f"({'; '.join(why)})")
    return True, ("step guard: on the device (the fused AdamW skips a refused step; the loss, gradient norm and "
                  "verdict are read a step later)")


class DeviceGuard:
    """The guard's state on the device, mirroring the host's DivergenceGuard (general.max_loss_ratio and
    general.max_weight_growth, 0 = off)."""

    def __init__(self, guard: DivergenceGuard, agree: RankAgreement, device: torch.device) -> None:
        self.guard, self.agree = guard, agree
        f64 = {"dtype": torch.float64, "device": device}
        first = math.nan if guard.first_loss is None else guard.first_loss  # nan: not yet seen
        self.first_loss = torch.full((), first, **f64)
        self.last_norm = torch.full((), math.nan, **f64)  # the weights' norm at the last check (nan: none yet)
        self.halted = torch.zeros((), dtype=torch.float32, device=device)

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor,
              weights_sq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Before the optimizer step, on every rank together: (the verdict, a float32 0-d tensor, 1 = skip the
        step; the float64 values to read back, in the order of `Values`). `weights_sq`: this rank's squared
        norm of the weights the step starts from."""
        loss64, norm64 = loss.detach().to(torch.float64), grad_norm.detach().to(torch.float64)
        not_finite = ~(torch.isfinite(loss64) & torch.isfinite(norm64))
        reduced = self.agree.control_on_device(not_finite, weights_sq)
        refuse = (reduced[0] > 0) | (self.halted > 0)
        total_sq = reduced[2]
        norm = torch.where(torch.isfinite(total_sq), total_sq.sqrt(), math.inf)  # as check_weights reads it
        growth, ratio = self.guard.max_weight_growth, self.guard.max_loss_ratio
        if growth:  # a nan last norm (no check yet) compares False
            refuse |= (self.last_norm != 0) & (norm > growth * self.last_norm)
        first_seen = ~torch.isnan(self.first_loss)
        if ratio:
            refuse |= first_seen & (loss64 > ratio * self.first_loss)
        self.last_norm = norm
        self.first_loss = torch.where(first_seen | ~torch.isfinite(loss64), self.first_loss, loss64)
        self.halted = refuse.to(torch.float32)
        values = torch.stack([reduced[0], reduced[1], total_sq, loss64, norm64, refuse.to(torch.float64)])
        return self.halted, values


class Readback:
    """Device values on their way to the host without waiting: on CUDA copied into pinned memory behind an event,
    so that reading them waits for the work that made them, not for the steps queued since."""

    def __init__(self, values: torch.Tensor) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def read(self) -> Values:
        if self.event is not None:
            self.event.synchronize()
        return Values(*self.host.tolist())
