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
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P

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
    sending = [encoders[b] for b in sorted(encoders) if b not in decoders]  # the peer decodes: stage me + 1
    receiving = [decoders[b] for b in sorted(decoders) if b not in encoders]  # the peer encodes: stage me - 1
    for b in sorted(set(encoders) & set(decoders)):
        _local(encoders[b], decoders[b])
    outgoing = {id(side): _outgoing(side, sender=True) for side in sending}
    for side in sending:
        p2p.send_tensors([outgoing[id(side)]], to_rank=me + 1, kind=KIND)
    for side in receiving:
        theirs = p2p.recv_tensors(1, from_rank=me - 1, kind=KIND)[0]
        mine = _outgoing(side, sender=False)
        p2p.send_tensors([mine], to_rank=me - 1, kind=KIND)
        _combine(side, mine, theirs, sender=False)
    for side in sending:
        _combine(side, outgoing[id(side)], p2p.recv_tensors(1, from_rank=me + 1, kind=KIND)[0], sender=True)
    for side in list(encoders.values()) + list(decoders.values()):
        side.step_ids.clear()


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
