"""Which parameters Muon trains, and which get weight decay.

Muon orthogonalises 2-D updates, which suits the hidden matrices of the decoder layers. The
embedding and the output head are 2-D too but are lookup / classifier matrices whose rows are
tokens, so (following the Muon paper and torch's docs) they stay on AdamW, with norms, biases
and every other non-2-D parameter. Names follow our model: the embedding module is
`token_embedding`, the head `lm_head`, norm modules contain `norm`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

import torch

NamedParams = List[Tuple[str, torch.nn.Parameter]]

_ADAMW_2D_MODULES = ("token_embedding", "lm_head")


# Roles are parameter attributes, not module methods: a technique may give a role to a parameter of a module
# it does not own (Subspace Models tag nanotron's row-parallel output weights), and the parameter object is
# the one handle that module, the technique and build_optimizer share. They are set on the final parameter:
# nanotron re-creates parameters when it wraps or shards them, dropping attributes set earlier.
_TAG = "_nanotron_ext_optimizer_group"


def tag_parameter(param: torch.nn.Parameter, tag: str) -> None:
    """Hand `param` to the optimiser its technique builds for `tag` (declared under "optimizer group")
    instead of the default split (a technique's own rule: Stiefel projections, subspace-constrained rows)."""
    setattr(param, _TAG, tag)


def parameter_tag(param: torch.nn.Parameter) -> Optional[str]:
    return getattr(param, _TAG, None)


_EMBEDDING = "_nanotron_ext_embedding_table"


def mark_embedding_table(param: torch.nn.Parameter) -> None:
    """A technique's token-indexed table (rows are tokens, e.g. MAPL's anchor embeddings): it stays on
    AdamW like the model's own embedding, whatever its module is called."""
    setattr(param, _EMBEDDING, True)


def _is_norm_or_bias(name: str) -> bool:
    return "norm" in name.lower() or name.endswith("bias")


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """True for 2-D hidden matrices (decoder-layer linear weights).

    False for the embedding (`token_embedding`), the head (`lm_head`), norm weights (name contains
    "norm"), biases, and anything that is not exactly 2-D.
    """
    if param.ndim != 2 or getattr(param, _EMBEDDING, False):
        return False
    if any(module in name for module in _ADAMW_2D_MODULES):
        return False
    return not _is_norm_or_bias(name)


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Decoupled weight decay for matrices (embedding and head included), never norms, biases or 1-D."""
    return param.ndim >= 2 and not _is_norm_or_bias(name)


@dataclasses.dataclass
class ParamSplit:
    muon: NamedParams
    """2-D hidden matrices (weight decay applies)."""
    adamw_decay: NamedParams
    """AdamW with weight decay: embedding, head, and hidden matrices when Muon is off."""
    adamw_no_decay: NamedParams
    """AdamW without weight decay: norms, biases, other non-2-D parameters."""
    tagged: Dict[str, NamedParams] = dataclasses.field(default_factory=dict)
    """Parameters a technique tagged (tag_parameter), by tag; none of them is in the other groups."""


def split_params(named_params: Iterable[Tuple[str, torch.nn.Parameter]], use_muon: bool) -> ParamSplit:
    """Sort trainable parameters into the three groups; a parameter seen twice (tied) is kept once."""
    split = ParamSplit([], [], [])
    seen = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        tag = parameter_tag(p)
        if tag is not None:
            split.tagged.setdefault(tag, []).append((name, p))
        elif use_muon and is_muon_param(name, p):
            split.muon.append((name, p))
        elif uses_weight_decay(name, p):
            split.adamw_decay.append((name, p))
        else:
            split.adamw_no_decay.append((name, p))
    return split
