"""SPEL: the Stiefel-manifold optimiser MAPL trains its boundary projections with.

For a parameter A in St(d, r) (A^T A = I, stored [d, r]) and its Euclidean gradient g:

    g_R = g - A sym(A^T g)                  Riemannian gradient (embedded metric), A^T g_R skew
    m   = beta m + (1 - beta) g_R           heavy-ball momentum
    D   = polar(m)                          direction, by PolarExpress (nanotron_ext.optim.polar_express)
    A  <- polar(A - lr D)                   retraction onto St(d, r)

The retraction must land on the manifold to float precision (five bf16 PolarExpress steps do not),
so it uses the exact polar factor U V^T from torch.linalg.svd of the small [d, r] matrix, in fp64.
beta and the PolarExpress step count are not stated in the MAPL text: optimizer.spel in the config.

`optimizer.spel.mode` keeps SPEL ("stiefel") or runs the manifold-unaware ablation MAPL compares it with
("manifold escape": the text reports it worse than fixed bases). Every mode keeps the momentum, the
polar direction and the lr, so only the geometry differs:
- euclidean:     g_R = g (no tangent projection), A <- A - lr D (no retraction): A leaves St(d, r);
- euclidean_qr:  the same step, then A <- qr(A).Q (diag R > 0): orthonormal again, but the step ignored
                 the tangent space (naive re-orthonormalisation);
- fixed:         A is never updated (the fixed random basis).
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from nanotron_ext.config.schema import OptimizerConfig
from nanotron_ext.mapl.technique import SPEL_TAG as TAG
from nanotron_ext.optim.polar_express import polar_express

MODES = ("stiefel", "euclidean", "euclidean_qr", "fixed")


def riemannian_gradient(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Projection of g onto the tangent space of St(d, r) at a: g - a sym(a^T g)."""
    atg = a.T @ g
    return g - a @ ((atg + atg.T) / 2)


def qr_orthonormalise(x: torch.Tensor) -> torch.Tensor:
    """Q of x = QR with diag(R) > 0 (unique; no sign flips between steps), in fp64."""
    q, r = torch.linalg.qr(x.double())
    return (q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)).to(x.dtype)


def polar_factor(x: torch.Tensor) -> torch.Tensor:
    """Exact polar factor U V^T (the closest matrix with orthonormal columns), computed in fp64."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return (u @ vh).to(x.dtype)


class SPEL(torch.optim.Optimizer):
    """Riemannian heavy-ball on the Stiefel manifold with PolarExpress directions (see module doc)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.9,
                 polar_steps: int = 5, mode: str = "stiefel") -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"SPEL momentum must be in [0, 1), got {momentum}")
        if mode not in MODES:
            raise ValueError(f"SPEL mode must be one of {MODES}, got {mode!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, polar_steps=polar_steps, mode=mode))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2 or p.shape[0] < p.shape[1]:
                    raise ValueError(f"SPEL parameters are tall [d, r] matrices, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta, mode = group["momentum"], group["mode"]
            for p in group["params"]:
                if p.grad is None or mode == "fixed":
                    continue
                g = riemannian_gradient(p, p.grad) if mode == "stiefel" else p.grad
                m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                m.mul_(beta).add_(g, alpha=1 - beta)
                direction = polar_express(m, steps=group["polar_steps"], dtype=torch.float32)
                stepped = p - group["lr"] * direction
                if mode == "stiefel":
                    stepped = polar_factor(stepped)
                elif mode == "euclidean_qr":
                    stepped = qr_orthonormalise(stepped)
                p.copy_(stepped)
        return loss


def build_spel(params: List[torch.nn.Parameter], cfg: OptimizerConfig) -> SPEL:
    """SPEL at optimizer.spel.lr_scale x the model lr (MAPL: 0.1x); its group is named for logging."""
    base_lr = cfg.muon_lr if cfg.name == "muon" else cfg.lr
    opt = SPEL(params, lr=cfg.spel.lr_scale * base_lr, momentum=cfg.spel.momentum, polar_steps=cfg.spel.polar_steps,
               mode=cfg.spel.mode)
    for group in opt.param_groups:
        group["name"] = TAG
    return opt
