"""A TP-sharded parameter and its unsharded tensor (nanotron's ShardedInfo says which slice this rank holds)."""
from __future__ import annotations

import torch
from nanotron.parallel.parameters import NanotronParameter


def full_shape(param: torch.Tensor) -> torch.Size:
    """The unsharded shape of `param` (its own shape when it is not sharded)."""
    if isinstance(param, NanotronParameter) and param.is_sharded:
        return torch.Size(param.get_sharded_info().unsharded_shape)
    return param.shape


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` (a tensor of the parameter's unsharded shape)."""
    if not (isinstance(param, NanotronParameter) and param.is_sharded):
        return full
    out = torch.empty(param.shape, dtype=full.dtype, device=full.device)
    for pair in param.get_sharded_info().local_global_slices_pairs:
        out[pair.local_slices] = full[pair.global_slices]
    return out
