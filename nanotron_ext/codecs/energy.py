"""How much of a boundary activation a projection keeps: the measure Subspace Models' and MAPL's analyses
share (nanotron_ext/subspace/analyse.py, nanotron_ext/mapl/analyse.py)."""
from __future__ import annotations

import torch


def energy_kept(x: torch.Tensor, basis: torch.Tensor) -> float:
    """||X B||_F^2 / ||X||_F^2: the share of the energy of the rows X [..., d] (read as [n, d]) inside span(B) for
    an orthonormal basis B [d, k], in float64; 1.0 when X has no energy."""
    x = x.detach().double().reshape(-1, x.shape[-1])
    total = x.square().sum()
    return float((x @ basis.double()).square().sum() / total) if total > 0 else 1.0
