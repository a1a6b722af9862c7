"""The dense equivalent of a model: the weights a standard full-rank Llama computing the same function holds.

Export to other frameworks and import from them (nanotron_ext.hf) work on the *standard layout*: the
parameter names and unsharded shapes our full-rank model has (one `weight` per linear, one token table, the
norms), with each linear under its own name (`attn.q_proj.weight`, ...) or fused as the megatron strategy
fuses them (`attn.qkv_proj.weight`; nanotron_ext.hf.names splits and fuses those).

A module whose parameters are not in that layout but whose function a standard module computes exactly (a
low-rank pair y = up(down(x)), a projection reparameterised as W = U W_small, a split token table, a boundary
codec that reconstructs exactly) states it by implementing `DenseEquivalent`; the walk below replaces the
module's own parameters by what it states. The core names no technique: technique modules implement the
two methods. A boundary codec (BoundaryEncoder / BoundaryDecoder) has no counterpart in a standard model, so
it must implement the protocol (stating `{}`: "I am the identity") or the model has no dense equivalent.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Protocol, Tuple, runtime_checkable

import torch
import torch.distributed as torch_dist
from nanotron.parallel.parameters import NanotronParameter
from torch import nn

from nanotron_ext.codecs.base import BoundaryDecoder, BoundaryEncoder
from nanotron_ext.errors import NoDenseEquivalent
from nanotron_ext.parallel.shards import local_shard

FullTensor = Callable[[torch.Tensor], torch.Tensor]
"""Returns the unsharded value of one of this rank's parameters (a collective over the TP group: every TP rank
of a stage calls it for the same parameters in the same order); other tensors come back as they are."""


@runtime_checkable
class DenseEquivalent(Protocol):
    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        """Unsharded fp32 tensors of the standard module this one computes, keyed by names relative to this module
        (e.g. {"weight": up @ down}). Without an exact equivalent: raise NoDenseEquivalent when `exact`, else return
        the closest linear reading (used only to report how far an import moved the weights)."""

    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Set this module's parameters (this rank's shards) from unsharded standard tensors keyed as above; return
        the relative Frobenius error of every tensor it could only approximate (e.g. a truncated SVD)."""


def full_tensor(tensor: torch.Tensor, tp_pg: torch_dist.ProcessGroup) -> torch.Tensor:
    """The unsharded fp32 value of `tensor`: TP shards (nanotron's ShardedInfo) summed into place over `tp_pg`.
    Plain torch.distributed: this is not training traffic, so the comm ledger does not count it."""
    if not (isinstance(tensor, NanotronParameter) and tensor.is_sharded):
        return tensor.detach().float().cpu().clone()
    info = tensor.get_sharded_info()
    out = torch.zeros(info.unsharded_shape, dtype=torch.float32, device=tensor.device)
    for pair in info.local_global_slices_pairs:
        out[pair.global_slices] = tensor.detach()[pair.local_slices].float()
    torch_dist.all_reduce(out, group=tp_pg)  # every element is held by exactly one rank: the sum places it
    return out.cpu()


def _outermost(model: nn.Module) -> Dict[str, nn.Module]:
    """Modules implementing DenseEquivalent that no other such module contains, by name (they cover their children)."""
    found: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not _under(name, list(found)) and isinstance(module, DenseEquivalent):
            found[name] = module
    return found


def _codecs(model: nn.Module, covered: List[str]) -> Dict[str, nn.Module]:
    """Boundary codec modules no DenseEquivalent covers: they sit where a standard model has nothing."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, (BoundaryEncoder, BoundaryDecoder)) and not _under(n, covered)}


def _under(name: str, prefixes: List[str]) -> bool:
    return any(p == "" or name == p or name.startswith(f"{p}.") for p in prefixes)


def dense_state_dict(model: nn.Module, tp_pg: torch_dist.ProcessGroup, exact: bool = True) -> Dict[str, torch.Tensor]:
    """This rank's stage as unsharded fp32 tensors of the standard layout (identical on every TP rank of the
    stage); collective over TP. Raises NoDenseEquivalent when `exact` and some part has no equivalent; with
    `exact=False` (reports) codecs are left out and modules give their closest linear reading."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return full_tensor(t, tp_pg)

    covering = _outermost(model)
    codecs = _codecs(model, list(covering))
    if exact and codecs:
        name, module = next(iter(codecs.items()))
        kind = getattr(getattr(getattr(model, "cfg", None), "codec", None), "kind", "?")
        raise NoDenseEquivalent(f"model.codec.kind={kind!r} ({type(module).__name__} at {name}) changes what crosses "
                                "a layer boundary, which no standard architecture does")
    out: Dict[str, torch.Tensor] = {}
    for name, module in covering.items():
        for key, value in module.dense_equivalent(full, exact=exact).items():
            out[f"{name}.{key}" if name else key] = value.detach().float().cpu()
    skip = list(covering) + list(codecs)
    for name, param in model.named_parameters():
        if not _under(name, skip):
            out[name] = full(param)
    return out


@torch.no_grad()
def load_dense_state_dict_(model: nn.Module, dense: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, float], List[str]]:
    """Load unsharded standard-layout tensors into this rank's stage (each rank takes its shard; no collective).
    Modules implementing DenseEquivalent load their part themselves. Returns ({name: relative error} of what
    could only be approximated, names of codec parameters a standard model does not have, kept as initialised);
    raises KeyError naming any other parameter `dense` does not hold."""
    covering = _outermost(model)
    codecs = _codecs(model, list(covering))
    errors: Dict[str, float] = {}
    for name, module in covering.items():
        prefix = f"{name}." if name else ""
        part = {k[len(prefix):]: dense[k] for k in dense if k.startswith(prefix)}  # a lazy mapping reads only these
        errors.update({f"{prefix}{k}": e for k, e in module.load_dense_(part).items()})
    kept: List[str] = []
    for name, param in model.named_parameters():
        if _under(name, list(covering)):
            continue
        if _under(name, list(codecs)):
            kept.append(name)
            continue
        if name not in dense:
            raise KeyError(name)
        param.copy_(local_shard(dense[name].to(param.device), param).to(param.dtype))
    return errors, kept
