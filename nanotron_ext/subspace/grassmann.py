"""Grassmann updates of the shared basis (sec. 4.5 eq. 11, sec. 6): slowly rotate span(U) towards the
directions of the activation gradient that the projection throws away.

    f(U) = ||G - G U U^T||_F^2 summed over steps = tr(A) - tr(U^T A U),   A = sum G^T G
    Euclidean gradient -2 A U; Riemannian gradient xi = (I - U U^T)(-2 A U), so U^T xi = 0;
    U <- qr(U - eta xi).Q with the signs of Q fixed so that diag(R) > 0 (the retraction moves U
    continuously, so coordinates in U, T_S and W_small, change little for a small step).

Choices the paper leaves open (documented, and options in model.subspace):
- which G: the full gradient the receiving side of the LAST codec boundary sees (before projection);
  with one block per stage and the last block uncompressed this is the paper's "last compressed layer";
- A is normalised by its largest eigenvalue before the step, so grassmann_lr is a scale-free step size;
- A resets after each update (grassmann_reset) and is kept in checkpoints (each decoder's buffer);
- agreement: A is summed over all ranks (ranks without that boundary add zeros; TP/DP copies are
  averaged) with one all-reduce, so every rank computes the same new U from the same numbers instead of
  receiving a broadcast (d*d + 1 float64 per update, counted by the ledger as a world all-reduce). Several
  hubs in one process (simulated replicas of heterogeneous SparseLoCo) are averaged the same way and all
  take the one new U;
- the model follows the new basis: W_small <- U_new^T U_old W_small, full W <- U_new U_new^T W,
  T_S <- T_S U_old^T U_new (each projection of the old in-span part onto the new span), so the
  compressed model stays exact (equal to the uncompressed model with the moved weights). Optimiser
  state is left in the old coordinates (the rotation per update is small).
"""
from __future__ import annotations

from typing import Sequence

import torch
from nanotron import distributed as dist

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.subspace.basis import SubspaceHub

GRASSMANN_TAG = "grassmann"  # ledger: world all_reduce:grassmann, every grassmann_every steps (Technique.gated_work)


def grassmann_objective(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """f(U) = tr(A) - tr(U^T A U): the accumulated gradient energy outside span(U)."""
    return torch.trace(a) - torch.trace(u.T @ a @ u)


def riemannian_grad(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(I - U U^T)(-2 A U): the Euclidean gradient projected onto the tangent space at U."""
    egrad = -2.0 * (a @ u)
    return egrad - u @ (u.T @ egrad)


def retract(y: torch.Tensor) -> torch.Tensor:
    """Q of y = QR with diag(R) > 0 (the unique orthonormal basis of span(y) closest in that sense)."""
    q, r = torch.linalg.qr(y)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q * signs


def grassmann_step(a: torch.Tensor, u: torch.Tensor, lr: float) -> torch.Tensor:
    """One Riemannian gradient step with QR retraction; A is normalised to unit spectral norm."""
    a = a.double()
    top = torch.linalg.eigvalsh(a)[-1].clamp_min(torch.finfo(torch.float64).tiny)
    return retract(u.double() - lr * riemannian_grad(a / top, u.double())).to(u.dtype)


def agreed_gram(hubs: Sequence[SubspaceHub]) -> torch.Tensor:
    """The mean A of the last codec boundary over every decoder of `hubs` on every rank, identical on
    every rank (zeros when none accumulates). Sent through nanotron.distributed: the ledger counts it."""
    d = hubs[0].basis.shape[0]
    decoders = [dec for hub in hubs for dec in hub.decoders]
    device = hubs[0].basis.device  # NCCL reduces CUDA tensors only
    last = torch.tensor([max((dec.boundary for dec in decoders), default=-1)], dtype=torch.int64, device=device)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    ledger = get_ledger()
    if distributed:
        with ledger.tag(GRASSMANN_TAG):
            dist.all_reduce(last, op=dist.ReduceOp.MAX)
    buf = torch.zeros(d * d + 1, dtype=torch.float64, device=device)
    for dec in decoders:
        if dec.boundary == int(last):
            buf[:-1] += dec.grad_gram.double().flatten()
            buf[-1] += 1
    if distributed:
        with ledger.tag(GRASSMANN_TAG):
            dist.all_reduce(buf)
    count = float(buf[-1])
    return buf[:-1].view(d, d) / count if count else torch.zeros(d, d, dtype=torch.float64, device=device)


@torch.no_grad()
def move_onto(hub: SubspaceHub, u_new: torch.Tensor) -> None:
    """Replace U by u_new and move every in-span weight onto the new span (the model stays exact)."""
    u_old = hub.basis.clone()
    change = u_old.T @ u_new  # k x k: old coordinates -> new coordinates
    for lin in hub.constrained:
        if hasattr(lin, "weight_small"):
            lin.weight_small.copy_(change.T.to(lin.weight_small.dtype) @ lin.weight_small)
        else:
            lin.weight.copy_(u_new @ (u_new.T @ lin.weight))
    for emb in hub.low_rank_tables:
        table = emb.small.weight
        table.copy_(table @ change.to(table.dtype))
    hub.basis.copy_(u_new)


@torch.no_grad()
def grassmann_update(hubs: Sequence[SubspaceHub], move_weights: bool = True) -> bool:
    """Every rank calls this at the same step with its hubs (all holding the same U); returns False when no
    decoder accumulated anything. `move_weights=False` replaces U only (heterogeneous SparseLoCo: the
    replicas' weights must stay identical, and embedding adaptation re-splits the table on the new U)."""
    a = agreed_gram(hubs)
    for hub in hubs:
        if hub.cfg.subspace.grassmann_reset:
            for dec in hub.decoders:
                dec.grad_gram.zero_()
    if not torch.any(a != 0):
        return False
    u_new = grassmann_step(a.to(hubs[0].basis.device), hubs[0].basis, hubs[0].cfg.subspace.grassmann_lr)
    for hub in hubs:
        if move_weights:
            move_onto(hub, u_new)
        else:
            hub.basis.copy_(u_new)
    return True
