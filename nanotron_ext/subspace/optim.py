"""The modified AdamW of Subspace Models (sec. 5, eq. 12-14), for output projections kept in span(U).

AdamW divides each coordinate by its own sqrt(v), which rotates a column of W out of span(U) even when
the gradient's columns lie in it. The paper replaces v by its mean over the d output coordinates: in
PyTorch's nn.Linear layout W [d_out = d, d_in] that is the mean over dim 0, ONE SCALAR PER INPUT COLUMN
(the paper writes x W with W [d_in, d] and averages each d-wide row; same thing). Each column's update is
then m's column times one scalar, and decoupled weight decay scales W: an in-span W with in-span
gradients stays in span(U). Under TP the row-parallel projections shard d_in, so the mean over dim 0 is
local (no communication).
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from nanotron_ext.config.schema import OptimizerConfig
from nanotron_ext.subspace.technique import SUBSPACE_ADAMW_TAG


class ColumnMeanAdamW(torch.optim.Optimizer):
    """AdamW with v replaced by its mean over dim 0 (bias-corrected like AdamW; eps outside the sqrt)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim != 2:
                    raise ValueError("ColumnMeanAdamW steps 2-D weights [d_out, d_in] only")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros(p.shape[1], dtype=p.dtype, device=p.device)
                state["step"] += 1
                t = state["step"]
                g = p.grad
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                # eq. 13: the second moment of the column mean of g^2 (one scalar per input column)
                state["exp_avg_sq"].mul_(b2).add_(g.square().mean(dim=0), alpha=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                step_size = group["lr"] / (1 - b1**t)
                p.addcdiv_(state["exp_avg"], denom.unsqueeze(0).expand_as(p), value=-step_size)
        return loss


def subspace_adamw(params: List[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return ColumnMeanAdamW([{"params": params, "name": SUBSPACE_ADAMW_TAG}], lr=cfg.lr, betas=tuple(cfg.betas),
                           eps=cfg.eps, weight_decay=cfg.weight_decay)
