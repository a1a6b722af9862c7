"""Layout-independent weight init (shard slicing: nanotron_ext.parallel.shards).

Every parameter is drawn in full from a generator seeded by (seed, parameter name), then each
rank keeps its slice (nanotron's ShardedInfo says which). Names do not depend on the parallel
layout, so a TP=2 x PP=2 model starts from exactly the weights of the single-process model:
parity tests and "change the layout, keep the run" both rely on this.
"""
from __future__ import annotations

import math
import zlib
from typing import Dict

import torch
from torch import nn

from nanotron_ext.parallel.shards import full_shape, local_shard  # noqa: F401  (also imported from here)

# parameters whose output feeds the residual stream: std scaled by 1/sqrt(2 * num_layers) (GPT-2)
RESIDUAL_OUTPUT_NAMES = ("o_proj", "down_proj")
# factors of a low-rank linear y = up(down(x)): down [r, in], up [out, r] (nanotron_ext.boost.lowrank)
LOW_RANK_FACTORS = {".down.weight": 0, ".up.weight": 1}  # suffix -> dim holding r


class SelfInitialising:
    """A module whose parameters need a structured init (e.g. an orthonormal projection held identically on
    both sides of a pipeline boundary): init_weights_ calls its `init_own_parameters_` instead of drawing its
    parameters by name."""

    def init_own_parameters_(self, seed: int) -> None:
        raise NotImplementedError


# A parameter attribute, not a module method: the zero-init parameter is one of a plain nn.Linear's (ResBM's
# last encoder linear), and the parameter object is the only handle its module, init_weights_ and checkpoints
# share. It is set on the final parameter (nanotron re-creates parameters when it wraps them, dropping marks).
_ZERO_INIT = "_nanotron_ext_zero_init"


def mark_zero_init(param: torch.Tensor) -> None:
    """Have init_weights_ start `param` at zero (e.g. a residual branch's last linear, so the block
    starts as the identity)."""
    setattr(param, _ZERO_INIT, True)


def is_zero_init(param: torch.Tensor) -> bool:
    return bool(getattr(param, _ZERO_INIT, False))


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62))


def init_std(name: str, std: float, num_layers: int) -> float:
    if any(f".{n}." in f".{name}" for n in RESIDUAL_OUTPUT_NAMES):
        return std / math.sqrt(2 * num_layers)
    return std


def factor_std(product_std: float, rank: int) -> float:
    """Std of each factor of a low-rank linear so that up @ down has the full-rank init's std.

    Entries of up @ down are sums of r products of independent N(0, s^2) entries: variance r s^4.
    Equal stds for both factors (neither is privileged); the residual-output scaling is part of
    `product_std`. CoLA's silu between the factors and LaX's added latent change the effective
    scale by O(1) factors, as in those papers' own inits.
    """
    return math.sqrt(product_std / math.sqrt(rank))


def full_init_tensor(name: str, shape: torch.Size, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The unsharded initial value of parameter `name` (fp32): norms 1, other vectors 0, matrices normal."""
    if len(shape) == 1:
        return torch.ones(shape) if "norm" in name else torch.zeros(shape)
    sigma = init_std(name, std, num_layers)
    for suffix, rank_dim in LOW_RANK_FACTORS.items():
        if name.endswith(suffix):
            sigma = factor_std(sigma, shape[rank_dim])
    return torch.empty(shape).normal_(0.0, sigma, generator=_generator(seed, name))


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Initialise every parameter of `model` in place, independent of TP/PP layout.

    A `SelfInitialising` module initialises its own parameters (structured inits such as an orthonormal
    projection held identically on both sides of a boundary)."""
    own, done = set(), []
    for name, module in model.named_modules():
        if isinstance(module, SelfInitialising) and not any(name.startswith(d + ".") for d in done):
            module.init_own_parameters_(seed)  # once: a self-initialising child is covered by its parent
            done.append(name)
            own.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in own:
            continue
        if is_zero_init(param):
            param.zero_()
            continue
        full = full_init_tensor(name, full_shape(param), seed, std, num_layers)
        param.copy_(local_shard(full, param).to(param.dtype))


@torch.no_grad()
def load_full_state_dict_(model: nn.Module, full: Dict[str, torch.Tensor]) -> None:
    """Load unsharded tensors (e.g. a single-process model's state_dict) into a sharded model."""
    for name, param in model.named_parameters():
        if name not in full:
            raise KeyError(f"parameter {name} missing from the full state dict")
        param.copy_(local_shard(full[name], param).to(param.dtype))
