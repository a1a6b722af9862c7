"""Float64 single-process references for Subspace Models tests, written on top of tests/reference_llama.py
(which shares no code with the model): the effective weights of a subspace model are built here from
their definitions, TE = T_fixed + T_S U^T and W_out = U W_small (or the projected full W), and the
reference's autograd gives the gradients of the trained factors."""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.init import full_init_tensor
from tests.reference_llama import params_from_shapes, reference_loss, reference_param_shapes

EMB = "token_embedding.pp_block.embedding.weight"
SMALL = "token_embedding.pp_block.embedding.small.weight"
OUTS = ("attn.o_proj", "mlp.down_proj")


def subspace_reference(
    cfg: ModelConfig, seed: int, u: torch.Tensor, fixed: torch.Tensor, rows: torch.Tensor,
    current: Optional[Callable[[str], torch.Tensor]] = None,
) -> Dict[str, torch.Tensor]:
    """Leaves (model parameter name -> float64 tensor with .grad) after backward of the reference loss.

    Initial weights by default (full_init_tensor, then W_small = U^T W or W = U U^T W as the constraint
    does); with `current`, each trained tensor's value is read by its model name instead."""
    u, fixed = u.double(), fixed.double()
    base = params_from_shapes(cfg, reference_param_shapes(cfg), seed)
    compressed = cfg.num_layers - 1 if cfg.subspace.last_block_uncompressed else cfg.num_layers
    outs = {f"decoder.{i}.pp_block.{mod}.weight" for i in range(compressed) for mod in OUTS}
    reparam = cfg.subspace.parameterisation == "reparam"

    def value(name: str, initial: torch.Tensor) -> torch.Tensor:
        return (current(name).detach().double() if current else initial.detach().double()).requires_grad_()

    leaves: Dict[str, torch.Tensor] = {}
    params: Dict[str, torch.Tensor] = {}
    for name, t in base.items():
        if name == EMB:
            init = full_init_tensor(SMALL, torch.Size((cfg.vocab_size, u.shape[1])), seed, cfg.init_std, cfg.num_layers)
            leaves[SMALL] = value(SMALL, init)
            params[EMB] = fixed + leaves[SMALL] @ u.T
        elif name in outs and reparam:
            leaves[name + "_small"] = value(name + "_small", u.T @ t)
            params[name] = u @ leaves[name + "_small"]
        elif name in outs:
            leaves[name] = params[name] = value(name, u @ (u.T @ t))
        else:
            leaves[name] = params[name] = value(name, t)
    loss = reference_loss(cfg, params, rows[:, :-1], rows[:, 1:])
    loss.backward()
    leaves["__loss__"] = loss.detach()
    return leaves
