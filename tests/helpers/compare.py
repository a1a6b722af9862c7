"""Comparing a sharded model's gradients with an unsharded reference's."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from nanotron_ext.models.init import local_shard


def worst_grad_error(model: torch.nn.Module,
                     reference: Dict[str, torch.Tensor]) -> Tuple[float, Optional[str], List[str]]:
    """Largest per-parameter relative error ||g - g_ref|| / ||g_ref|| (the reference sliced to this
    rank's shard), the parameter it occurs at, and the names of all parameters compared."""
    worst, worst_name, names = 0.0, None, []
    for name, param in model.named_parameters():
        names.append(name)
        expected = local_shard(reference[name].grad, param)
        rel = ((param.grad.double() - expected).norm() / expected.norm()).item()
        if rel > worst:
            worst, worst_name = rel, name
    return worst, worst_name, names
