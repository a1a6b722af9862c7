"""Keeping the two copies of a MAPL boundary's A_p and E_small_p equal: what crosses after each backward.

`model.codec.mapl.shared_sync` (the choice is argued in nanotron_ext/mapl/codec.py):
- "rows": the receiver's anchor-table gradient is already the whole gradient (the decoder takes the
  sender's share); it sends the gradient rows of the step's distinct ids, ascending, without indices (the
  ids crossed with Z, so both sides know them); the two partial gradients of A_p are swapped. Everything in
  the wire dtype; each side sums the same rounded values in the same order (sender's + receiver's).
- "dense": both sides swap their full fp32 gradients of A_p and E_small_p and sum them.

Messages go through the pipeline's P2P (AccountedP2P: emulated links delay them, the ledger records
`send:codec_grads:fwd` / `:bwd`). Every rank first sends its sender sides' parts, then answers its
receiver sides, then takes its sender sides' answers: the boundaries' exchanges overlap instead of
running one after another down the pipeline, and the first operation of every rank but the last is a
send the next rank's first receive matches, so nothing deadlocks. Bytes per boundary per step (element
size e of the wire dtype, U distinct ids of the step):
    rows:  forward d r e                 backward (d r + U m) e
    dense: forward (d r + V m) 4         backward (d r + V m) 4

On a residual stream sharded over TP (BTP; nanotron_ext/mapl/codec.py) every TP rank holds whole, replicated
copies of A_p and E_small_p but uses only its features' rows, so its gradients are partial sums over the
feature shards: each side first all-reduces them over TP (ONE flat all-reduce per side in the fast TP group,
ledger `all_reduce:codec_grads`; the encoder's anchor table is skipped under "rows": its gradient is taken on
the receiver), so every TP rank holds the whole gradient. The messages are then the same on every TP rank, so
each crosses the slow link ONCE: each TP rank sends 1/tp of it (flattened, zero-padded to a multiple of tp) to
the same TP rank of the peer stage, which all-gathers the slices over TP (ledger `all_gather:codec_grads`),
as the pipeline does with a replicated wire (nanotron_ext/parallel/p2p.py). Bytes over the link per boundary
are those above, up to that padding, at any tp. Under Megatron TP (a replicated stream) every TP rank computes
the same gradients, so with parallelism.pp_scatter_gather (the default) the messages are sliced the same way
with no all-reduce first; with it off every TP rank sends its own copy (tp x the bytes, for comparison).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.p2p import gather_slices, own_slice

KIND = "codec_grads"  # ledger: send:codec_grads:fwd / send:codec_grads:bwd


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient; zeros if this side saw no micro-batch (it still takes part)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


@torch.no_grad()
def sync_boundaries(encoders: Dict[int, Any], decoders: Dict[int, Any], p2p: P2P) -> None:
    """Equal gradients for both copies of every boundary this rank holds a side of (MaplEncoder / MaplDecoder
    by boundary)."""
    me = dist.get_rank(p2p.pg)
    for b in sorted(encoders):  # the same order on every TP rank
        _reduce_over_tp(encoders[b], sender=True)
    for b in sorted(decoders):
        _reduce_over_tp(decoders[b], sender=False)
    sending = [encoders[b] for b in sorted(encoders) if b not in decoders]  # the peer decodes: stage me + 1
    receiving = [decoders[b] for b in sorted(decoders) if b not in encoders]  # the peer encodes: stage me - 1
    for b in sorted(set(encoders) & set(decoders)):
        _local(encoders[b], decoders[b])
    outgoing = {id(side): _outgoing(side, sender=True) for side in sending}
    for side in sending:
        _send(p2p, side, outgoing[id(side)], me + 1)
    for side in receiving:
        theirs = _recv(p2p, side, me - 1, _length(side, from_sender=True))
        mine = _outgoing(side, sender=False)
        _send(p2p, side, mine, me - 1)
        _combine(side, mine, theirs, sender=False)
    for side in sending:
        _combine(side, outgoing[id(side)], _recv(p2p, side, me + 1, _length(side, from_sender=False)), sender=True)
    for side in list(encoders.values()) + list(decoders.values()):
        side.step_ids.clear()


def _reduce_over_tp(side: Any, sender: bool) -> None:
    """On a sharded stream: this TP rank's partial gradients summed over TP (module doc), in one all-reduce."""
    pg = side.sharded_pg
    if pg is None:
        return
    proj = side.projection
    params = [proj.A] if sender and side.shared_sync == "rows" else [proj.A, proj.anchor_table]
    flat = torch.cat([_grad(p).reshape(-1) for p in params])
    with get_ledger().tag(KIND):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _slicing_pg(side: Any, p2p: P2P) -> Optional[dist.ProcessGroup]:
    """The TP group whose ranks each carry 1/tp of a message: a sharded side's (its gradients were all-reduced
    over TP), or under a replicated stream the pipeline's scatter/gather group (parallelism.pp_scatter_gather:
    every TP rank computed the same gradients); None: every TP rank sends the whole message."""
    if side.sharded_pg is not None:
        return side.sharded_pg
    pg = getattr(p2p, "tp_pg", None)
    return pg if pg is not None and pg.size() > 1 else None


def _send(p2p: P2P, side: Any, message: torch.Tensor, to_rank: int) -> None:
    """The message (the same on every TP rank) once over the link: this TP rank's 1/tp (`_slicing_pg`)."""
    pg = _slicing_pg(side, p2p)
    p2p.send_tensors([message if pg is None else own_slice(message, pg)], to_rank=to_rank, kind=KIND)


def _recv(p2p: P2P, side: Any, from_rank: int, numel: int) -> torch.Tensor:
    """The peer's message of `numel` values: whole, or this TP rank's slice all-gathered over TP (`_send`)."""
    part = p2p.recv_tensors(1, from_rank=from_rank, kind=KIND)[0]
    pg = _slicing_pg(side, p2p)
    if pg is None:
        return part
    with get_ledger().tag(KIND):
        return gather_slices(part, pg)[:numel]


def _length(side: Any, from_sender: bool) -> int:
    """Values in the message the peer side sends (both sides know it: the step's ids crossed with Z)."""
    proj = side.projection
    if side.shared_sync == "dense":
        return sum(p.numel() for p in proj.parameters())
    return proj.A.numel() + (0 if from_sender else side.touched_rows().numel() * proj.anchor_table.shape[1])


def _local(encoder: Any, decoder: Any) -> None:
    """Both sides on this process: A's partials summed; the table's gradient is the decoder's ("rows") or
    the sum of both ("dense")."""
    enc, dec = encoder.projection, decoder.projection
    total = _grad(enc.A) + _grad(dec.A)
    enc.A.grad.copy_(total)
    dec.A.grad.copy_(total)
    table = _grad(dec.anchor_table)
    if encoder.shared_sync == "dense":
        table.add_(_grad(enc.anchor_table))
    _grad(enc.anchor_table).copy_(table)


def _outgoing(side: Any, sender: bool) -> torch.Tensor:
    """What this side sends: rows: A's partial (+ the table's gradient rows from the receiver), wire dtype;
    dense: every gradient, fp32."""
    proj = side.projection
    if side.shared_sync == "dense":
        return torch.cat([_grad(p).float().reshape(-1) for p in proj.parameters()])
    a_mine = _grad(proj.A).to(side.wire_dtype).reshape(-1)
    if sender:
        return a_mine
    rows = _grad(proj.anchor_table)[side.touched_rows()].to(side.wire_dtype)
    return torch.cat([a_mine, rows.reshape(-1)])


def _combine(side: Any, mine: torch.Tensor, theirs: torch.Tensor, sender: bool) -> None:
    """Set this side's gradients from both sides' messages, summed in the same order on both (sender's first)."""
    proj = side.projection
    if side.shared_sync == "dense":
        total = mine + theirs if sender else theirs + mine
        offset = 0
        for p in proj.parameters():
            p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return
    n = proj.A.numel()
    first, second = (mine, theirs) if sender else (theirs, mine)
    proj.A.grad.copy_((first[:n].float() + second[:n].float()).view_as(proj.A))
    rows = side.touched_rows()
    table = _grad(proj.anchor_table)
    table.zero_()
    table[rows] = (theirs if sender else mine)[n:].float().view(rows.numel(), table.shape[1])
