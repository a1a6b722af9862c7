"""torch.optim.Muon that orthogonalises the FULL matrix of tensor-parallel (sharded) weights.

Per-shard Muon would orthogonalise each TP shard on its own: a different update from the
single-device one (the shard's singular vectors are not the matrix's), and with the lr scaled
for the shard's shape instead of the matrix's. Here only the Newton–Schulz step sees the full
matrix, because it is the only non-elementwise part of torch's Muon step:

    buf.lerp_(grad, 1 - momentum)                      elementwise  -> on the local shard
    update = grad.lerp(buf, momentum) (nesterov)       elementwise  -> on the local shard
    O = NS(update)                                     full matrix  -> all-gather update over TP
    param *= 1 - lr * weight_decay                     elementwise  -> on the local shard
    param -= adjust_lr(lr, FULL shape) * O[my slice]   elementwise  -> on the local shard

So each step costs one all-gather per sharded matrix over the TP group (its local numel, sent
in bf16 by default, see `gather_dtype`), and every TP rank runs the same deterministic NS on
the same gathered tensor, then keeps its own slice. The result equals torch.optim.Muon on the
unsharded model up to the TP reduction-order noise in the gradients themselves.

Memory: the momentum buffer stays sharded (as in plain Muon on the shard); the only extra is
one transient full-size update (+ NS workspace) for the matrix being processed. This is the
"gather only the update" variant; the alternative of full-size proxy weights + momentum on
every TP rank would cost at least (2 * full - shard) extra floats per matrix and rank for the same
result. A further saving, not implemented: give each TP rank a disjoint subset of matrices to
orthogonalise and all-gather the results, so NS compute is split instead of replicated.

Newton–Schulz and the lr adjustment are torch's own (`torch.optim._muon`), so the update
tracks torch's Muon exactly; tests/test_optim.py checks the result against it. torch's NS runs in
bf16; `ns_dtype` (optimizer.muon_ns_dtype) runs the same iteration in fp32 instead (`newton_schulz`):
on CPUs without native bf16 matmuls (e.g. the 2-core EPYC of our CI) bf16 is 5-20x slower and
dominated the step time of every Muon run at CPU scale.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import nanotron.distributed as dist
import torch
from torch.optim._muon import (  # torch's Muon internals: the same NS and lr adjustment as torch.optim.Muon
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.optim._muon import muon as _torch_muon
from torch.optim.optimizer import ParamsT

from nanotron_ext.optim.polar_express import polar_express

Slices = Tuple[slice, ...]


def newton_schulz(grad: torch.Tensor, ns_coefficients: Tuple[float, float, float], ns_steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` (the same quintic X <- aX + (bA + cA^2)X, A = X X^T, on the wide
    orientation after X / max(||X||_F, eps)) computed in `dtype`; torch's own always casts to bf16.
    Written out because torch exposes no dtype argument."""
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz expects a matrix, got shape {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    tall = grad.shape[0] > grad.shape[1]
    x = (grad.T if tall else grad).to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
    """Where every TP rank's local shard of one matrix sits in the full matrix."""

    full_shape: torch.Size
    pieces: Tuple[Tuple[Tuple[Slices, Slices], ...], ...]
    """pieces[tp_rank] = ((local_slices, global_slices), ...) for that rank's shard."""
    rank: int

    def assemble(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        full = shards[0].new_empty(self.full_shape)
        for shard, pairs in zip(shards, self.pieces):
            for local, glob in pairs:
                full[glob] = shard[local]
        return full

    def local_part(self, full: torch.Tensor, local_shape: torch.Size) -> torch.Tensor:
        out = full.new_empty(local_shape)
        for local, glob in self.pieces[self.rank]:
            out[local] = full[glob]
        return out


def _tp_sharded(p: torch.Tensor) -> bool:
    """Sharded over more than one rank (nanotron also marks TP=1 weights as 'sharded' over one rank)."""
    return getattr(p, "is_sharded", False) and len(p.get_sharded_info().global_ranks) > 1


def _encode_pairs(p: torch.Tensor) -> torch.Tensor:
    """This rank's (local, global) slices of `p` as int64 [pairs, ndim, 4]: local start/stop, global start/stop."""
    info = p.get_sharded_info()
    rows = []
    for pair in info.local_global_slices_pairs:
        dims = []
        for d, (ls, gs) in enumerate(zip(pair.local_slices, pair.global_slices)):
            l0, l1, lstep = ls.indices(p.shape[d])
            g0, g1, gstep = gs.indices(info.unsharded_shape[d])
            if lstep != 1 or gstep != 1:
                raise ValueError("strided shard slices are not supported")
            dims.append([l0, l1, g0, g1])
        rows.append(dims)
    return torch.tensor(rows, dtype=torch.int64)


def _build_layouts(params: List[torch.Tensor], tp_pg: dist.ProcessGroup) -> Dict[int, _ShardLayout]:
    """Exchange every TP rank's shard slices once (one small all-gather), so each rank can assemble full matrices.

    Collective: every TP rank must build the optimizer over the same sharded params in the same order.
    """
    if not params:
        return {}
    tp_ranks = tuple(sorted(dist.get_global_rank(tp_pg, i) for i in range(tp_pg.size())))
    for p in params:
        if tuple(sorted(p.get_sharded_info().global_ranks)) != tp_ranks:
            raise ValueError(
                f"a parameter is sharded over ranks {p.get_sharded_info().global_ranks}, not over "
                f"the TP group {tp_ranks}"
            )
    encoded = [_encode_pairs(p) for p in params]
    flat = torch.cat([e.flatten() for e in encoded])
    device = params[0].device
    gathered = [torch.empty_like(flat, device=device) for _ in range(tp_pg.size())]
    dist.all_gather(gathered, flat.to(device), group=tp_pg)
    rank = dist.get_rank(tp_pg)
    layouts: Dict[int, _ShardLayout] = {}
    offset = 0
    for p, e in zip(params, encoded):
        n = e.numel()
        pieces = []
        for r in range(tp_pg.size()):
            rows = gathered[r][offset:offset + n].view(e.shape).tolist()
            pieces.append(tuple(
                (tuple(slice(d[0], d[1]) for d in pair), tuple(slice(d[2], d[3]) for d in pair)) for pair in rows
            ))
        offset += n
        full_shape = torch.Size(p.get_sharded_info().unsharded_shape)
        covered = sum(
            torch.Size([s.stop - s.start for s in glob]).numel() for pairs in pieces for _, glob in pairs
        )
        if covered != full_shape.numel():
            raise ValueError(f"TP shards cover {covered} of {full_shape.numel()} elements of a "
                             f"{tuple(full_shape)} matrix")
        layouts[id(p)] = _ShardLayout(full_shape=full_shape, pieces=tuple(pieces), rank=rank)
    return layouts


class TensorParallelMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton–Schulz step sees the full matrix of TP-sharded params.

    Same arguments and semantics as torch.optim.Muon (lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn), plus:

    tp_pg: the tensor-parallel group; needed when some param is sharded over more than one rank.
    gather_dtype: dtype the update is all-gathered in. torch's NS casts its input to bf16 as its
        first operation, so gathering in bf16 gives bit-identical results for half the bytes;
        None gathers in the parameter's dtype.

    orthogonaliser: "newton_schulz" (torch's quintic, `ns_coefficients`) or "polar_express" (the
        published per-step quintics, nanotron_ext.optim.polar_express; `ns_steps` iterations).
    ns_dtype: the orthogonaliser's compute dtype: bf16 (torch's) or fp32 (`newton_schulz`, module doc).

    With newton_schulz, params not sharded over >1 rank take torch's own Muon code path unchanged. State (the
    momentum buffers) has the local shard's shape, so state_dict() is per TP rank, like the
    model's weights. Construction is collective over tp_pg (one small all-gather of shard layouts)
    when there are sharded params; so is every step().
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        *,
        tp_pg: Optional[dist.ProcessGroup] = None,
        gather_dtype: Optional[torch.dtype] = torch.bfloat16,
        orthogonaliser: str = "newton_schulz",
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(
            params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        sharded = [p for g in self.param_groups for p in g["params"] if _tp_sharded(p)]
        if sharded and tp_pg is None:
            raise ValueError("TensorParallelMuon: tp_pg is required when parameters are sharded over several ranks")
        if orthogonaliser not in ("newton_schulz", "polar_express"):
            raise ValueError(f"optimizer.muon_orthogonaliser={orthogonaliser!r}: use newton_schulz or polar_express")
        self.orthogonaliser = orthogonaliser
        self.ns_dtype = ns_dtype
        self.tp_pg = tp_pg
        self.gather_dtype = gather_dtype
        self._layouts = _build_layouts(sharded, tp_pg) if sharded else {}

    def _gather_full(self, t: torch.Tensor, layout: _ShardLayout) -> torch.Tensor:
        send = (t if self.gather_dtype is None else t.to(self.gather_dtype)).contiguous()
        shards = [torch.empty_like(send) for _ in range(self.tp_pg.size())]
        dist.all_gather(shards, send, group=self.tp_pg)  # through nanotron.distributed: counted as tp/all_gather
        return layout.assemble(shards)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params: List[torch.Tensor] = []
            grads: List[torch.Tensor] = []
            bufs: List[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, bufs)
            hyper = dict(
                lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"], eps=group["eps"],
                ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
            )
            # torch's own Muon for unsharded matrices (its NS is bf16 only)
            torch_path = self.orthogonaliser == "newton_schulz" and self.ns_dtype == torch.bfloat16
            local = [i for i, p in enumerate(params) if id(p) not in self._layouts] if torch_path else []
            if local:
                _torch_muon(
                    [params[i] for i in local], [grads[i] for i in local], [bufs[i] for i in local],
                    has_complex=has_complex, **hyper,
                )
            lr = float(hyper["lr"])
            momentum = hyper["momentum"]
            for p, grad, buf in zip(params, grads, bufs):
                layout = self._layouts.get(id(p))
                if layout is None and torch_path:
                    continue
                # The elementwise part of torch's _single_tensor_muon, on the shard.
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if hyper["nesterov"] else buf
                full = update if layout is None else self._gather_full(update, layout)
                if torch_path:
                    ortho = _zeropower_via_newtonschulz(full, hyper["ns_coefficients"], hyper["ns_steps"], hyper["eps"])
                elif self.orthogonaliser == "newton_schulz":
                    ortho = newton_schulz(full, hyper["ns_coefficients"], hyper["ns_steps"],
                                          hyper["eps"], self.ns_dtype)
                else:
                    ortho = polar_express(full, steps=hyper["ns_steps"], dtype=self.ns_dtype)
                # The lr adjustment depends on the matrix's shape: the full one, not the shard's.
                adjusted_lr = _adjust_lr(lr, hyper["adjust_lr_fn"], p.shape if layout is None else layout.full_shape)
                p.mul_(1 - lr * hyper["weight_decay"])
                p.add_(ortho if layout is None else layout.local_part(ortho, p.shape), alpha=-adjusted_lr)
        return loss
