"""PolarExpress: the polar factor U V^T of a matrix by a short fixed sequence of odd quintic steps.

From "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm"
(Amsel et al., 2025, arXiv:2505.16932). Each step maps every singular value s to
p_t(s) = a_t s + b_t s^3 + c_t s^5 and leaves the singular vectors alone; the per-step coefficients
are chosen so the composition pushes [l, 1] towards 1 as fast as possible. Muon's Newton-Schulz
quintic is the special case of one coefficient set repeated. Hand-written because torch ships
only the Newton-Schulz variant (inside torch.optim.Muon).

Beyond the published steps. Each published polynomial trades exactness at s = 1 for speed on [l, 1]:
the last one, repeated, has its fixed point at s = 1.0354, so more steps would converge to
1.035 U V^T, not to U V^T. Steps after the fifth therefore use the Newton-Schulz quintic
p(s) = (15 s - 10 s^3 + 3 s^5) / 8 (the degree-5 member of the Newton-Schulz family for the polar
factor: p(1) = 1, p'(1) = p''(1) = 0, so the error e = 1 - s falls as ~e^3 per step; p is increasing and
p(s) - s = s (3 s^2 - 7)(s^2 - 1) / 8, so every s in (0, sqrt(7/3)) converges monotonically to 1, which
covers what five published steps leave of (0, 1]).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

# The published 5-step set (applied to X / (1.02 ||X||_F + 1e-6)).
COEFFICIENTS: Tuple[Tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Every step after the published ones: converges to exactly 1 (module docstring).
TAIL: Tuple[float, float, float] = (15 / 8, -10 / 8, 3 / 8)
SAFETY = 1.02
EPS = 1e-6


def step_coefficients(steps: int) -> Sequence[Tuple[float, float, float]]:
    """The coefficient set of each of `steps` iterations."""
    if steps < 1:
        raise ValueError(f"PolarExpress needs at least one step, got {steps}")
    return [COEFFICIENTS[t] if t < len(COEFFICIENTS) else TAIL for t in range(steps)]


def polar_express(x: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate polar factor of the 2-D matrix `x` (same shape), computed in `dtype` (default: x's).

    Works on the wide orientation (rows <= cols) so A = X X^T is the smaller Gram matrix.
    """
    if x.ndim != 2:
        raise ValueError(f"polar_express expects a matrix, got shape {tuple(x.shape)}")
    tall = x.shape[0] > x.shape[1]
    y = (x.T if tall else x).to(dtype or x.dtype)
    y = y / (SAFETY * y.norm() + EPS)
    for a, b, c in step_coefficients(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    y = y.T if tall else y
    return y.to(x.dtype)
