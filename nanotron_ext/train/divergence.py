"""Divergence, judged against the run's own history, so that diverged weights are never saved.

Two signs, both relative to the run itself (no absolute loss or norm is "too large" for every model):

- one optimizer step grows the norm of all weights more than `max_weight_growth` times (a runaway update:
  `optimizer.lr: 1e30` trained to finite 1e30 weights, saved them as "the last complete checkpoint", and
  the loss stayed finite because RMSNorm hides the scale);
- the loss exceeds `max_loss_ratio` times the run's first loss (at initialisation about ln V: a model
  worse than untrained has diverged).

The weight check runs before every save (and on the next step), so such weights never reach a checkpoint; the
loss check runs before the optimizer step. The non-finite checks stay as they are in the trainer. A value of
0 switches a check off. The first loss travels in checkpoints, so a resumed run keeps its reference.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch


def weight_sq_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of this rank's weights, in float64 (1e30 weights square past float32's range)."""
    norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in params]
    return torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64)


class DivergenceGuard:
    def __init__(self, max_loss_ratio: float, max_weight_growth: float) -> None:
        self.max_loss_ratio, self.max_weight_growth = max_loss_ratio, max_weight_growth
        self.first_loss: Optional[float] = None
        self._norm: Optional[float] = None  # the norm of all weights at the last check (this launch)

    def check_loss(self, step: int, loss: float) -> Optional[str]:
        """Why the loss of `step` shows divergence, or None; the first finite loss becomes the reference."""
        if self.first_loss is None:
            if math.isfinite(loss):
                self.first_loss = loss
            return None
        if self.max_loss_ratio and loss > self.max_loss_ratio * self.first_loss:
            return (f"step {step}: the loss {loss:.4g} is more than {self.max_loss_ratio:g}x the run's first loss "
                    f"{self.first_loss:.4g} (general.max_loss_ratio): training diverged")
        return None

    def check_weights(self, step: int, sq_norm: float) -> Optional[str]:
        """Why the weights after `step` (squared norm over all ranks) show divergence, or None."""
        norm = math.sqrt(sq_norm) if math.isfinite(sq_norm) else math.inf
        last, self._norm = self._norm, norm
        if last is None or not self.max_weight_growth or last == 0:
            return None
        if norm > self.max_weight_growth * last:
            return (f"step {step}: the optimizer step grew the weights' norm from {last:.4g} to {norm:.4g} "
                    f"(x{norm / last:.3g}, more than general.max_weight_growth={self.max_weight_growth:g} in one "
                    "step): training diverged")
        return None

    def state_dict(self) -> Dict[str, Optional[float]]:
        return {"first_loss": self.first_loss}

    def load_state_dict(self, state: Dict[str, Optional[float]]) -> None:
        self.first_loss = state.get("first_loss")
