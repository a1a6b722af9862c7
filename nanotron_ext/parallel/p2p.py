"""Pipeline point-to-point with byte accounting, optional link emulation and asymmetric wires.

Subclasses nanotron's P2P, which both pipeline engines use through `send_tensors` /
`recv_tensors`. Data messages are recorded as `send:fwd` / `recv:fwd` (to a later stage:
activations) or `send:bwd` / `recv:bwd` (to an earlier stage: gradients); nanotron's shape and
dtype headers as `send:meta` / `recv:meta`. Other traffic between neighbouring stages (a codec's
once-per-step exchange) passes a `kind` and is recorded as `send:<kind>:fwd` / `send:<kind>:bwd`,
on the same emulated links.

Asymmetric wires (a boundary codec's wire whose gradient needs more room than its forward payload,
nanotron_ext/codecs/base.py): a tensor marked with `mark_forward_columns(t, c)` is sent as its first
c columns only. Its header is the one nanotron writes for the view t[..., :c]
(non-contiguous, so its stride holds the full width); every other tensor is sent contiguous, so
the receiver knows a non-contiguous header means "c columns of a wider wire", receives the c
columns and pads the rest with zeros. The gradient of that full-width tensor then goes back whole.

The slow link carries each wire once (`scatter_gather`, parallelism.pp_scatter_gather; Megatron-LM's
scatter/gather of pipeline sends): a wire REPLICATED over the TP group (Megatron's residual stream, a
codec's wire computed the same on every TP rank) leaves each TP rank of the sending stage as 1/tp of its
flattened payload (padded to a multiple of tp), after the whole tensor's header; the TP ranks of the
receiving stage each take their slice and all-gather it over TP (ledger: `all_gather:pp-wire` in the tp
group). Its gradient, the same on every TP rank of the receiving stage, goes back the same way. A wire
SHARDED over TP (BTP's residual stream: each rank holds other features) is sent whole. Which stage pairs
carry a replicated wire is the model's to say (LlamaForTraining.replicated_wires, from
parallel/layout.place_boundaries); both ends know it, so nothing in the message marks it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, List, Optional, Set, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.link import LinkEmulator

_FORWARD_COLUMNS = "nanotron_ext_forward_columns"  # set on a tensor to send by mark_forward_columns
_FULL_WIDTH = "nanotron_ext_full_width"  # set on a receive buffer that holds the leading columns of a wider wire


def mark_forward_columns(wire: torch.Tensor, columns: int) -> torch.Tensor:
    """Declare that only wire[..., :columns] is sent forward (the rest is room for its gradient); returns wire."""
    setattr(wire, _FORWARD_COLUMNS, columns)
    return wire


def forward_columns(wire: torch.Tensor) -> Optional[int]:
    """The columns declared by `mark_forward_columns` (None: the whole tensor is sent)."""
    return getattr(wire, _FORWARD_COLUMNS, None)


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _narrowed(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The view of the leading forward columns of a marked wire, or None (send it whole)."""
    columns = forward_columns(tensor)
    if columns is None or columns >= tensor.shape[-1]:
        return None
    return tensor.contiguous()[..., :columns]


def _widen(buffer: torch.Tensor) -> torch.Tensor:
    """A received narrowed wire back at its full width, zeros in the columns that were not sent."""
    width = getattr(buffer, _FULL_WIDTH, None)
    if width is None:
        return buffer
    full = torch.nn.functional.pad(buffer.detach(), (0, width - buffer.shape[-1]))
    return full.requires_grad_(buffer.requires_grad)


def own_slice(payload: torch.Tensor, tp_pg: dist.ProcessGroup) -> torch.Tensor:
    """This TP rank's 1/tp of the flattened payload, zero-padded to a multiple of tp (what it sends of a message
    that is the same on every TP rank)."""
    tp, rank = tp_pg.size(), dist.get_rank(tp_pg)
    flat = payload.reshape(-1)
    size = -(-flat.numel() // tp)
    flat = torch.nn.functional.pad(flat, (0, size * tp - flat.numel()))
    return flat[rank * size:(rank + 1) * size].contiguous()


def gather_slices(part: torch.Tensor, tp_pg: dist.ProcessGroup) -> torch.Tensor:
    """The padded flat message back from every TP rank's `own_slice` (one all-gather over TP; the caller tags the
    ledger)."""
    whole = torch.empty(part.numel() * tp_pg.size(), dtype=part.dtype, device=part.device)
    dist.all_gather_into_tensor(whole, part.contiguous(), group=tp_pg)
    return whole


class AccountedP2P(P2P):
    def __init__(self, pg: dist.ProcessGroup, device: torch.device, link: Optional[LinkEmulator] = None) -> None:
        super().__init__(pg=pg, device=device)
        self.link = link
        self.ledger = get_ledger()
        self._received_widths: List[Optional[int]] = []
        self.tp_pg: Optional[dist.ProcessGroup] = None
        self._replicated_after: Set[int] = set()

    def scatter_gather(self, tp_pg: dist.ProcessGroup, replicated_after: Iterable[int]) -> None:
        """Send the wires leaving the stages in `replicated_after` (replicated over `tp_pg`) as 1/tp slices."""
        self.tp_pg, self._replicated_after = tp_pg, set(replicated_after)

    def _sliced(self, peer: int, kind: Optional[str]) -> bool:
        """A pipeline data message (activation or its gradient) of a TP-replicated wire, at tp > 1."""
        return (kind is None and self.tp_pg is not None and self.tp_pg.size() > 1
                and min(peer, dist.get_rank(self.pg)) in self._replicated_after)

    def _recv_sliced(self, num_tensors: int, from_rank: int, tag: int) -> List[torch.Tensor]:
        """Each tensor's header (the whole tensor's), this rank's slice, then the TP all-gather."""
        tp = self.tp_pg.size()
        out = []
        for _ in range(num_tensors):
            self._received_widths = []
            meta = self._recv_meta(from_rank=from_rank, tag=tag)
            numel = math.prod(int(n) for n in meta.shape)
            part = torch.empty(-(-numel // tp), dtype=meta.dtype, device=self.device)
            dist.recv(part, src=dist.get_global_rank(self.pg, from_rank), group=self.pg, tag=tag)
            with self.ledger.tag("pp-wire"):
                whole = gather_slices(part, self.tp_pg)
            buffer = whole[:numel].view(tuple(int(n) for n in meta.shape)).requires_grad_(meta.requires_grad)
            if self._received_widths[0] is not None:
                setattr(buffer, _FULL_WIDTH, self._received_widths[0])
            out.append(buffer)
        return out

    def _direction(self, peer: int, sending: bool) -> str:
        # activations flow to later stages: a send to a later stage or a recv from an earlier one is "fwd"
        peer_is_later = peer > dist.get_rank(self.pg)
        return "fwd" if peer_is_later == sending else "bwd"

    def _tag(self, peer: int, sending: bool, kind: Optional[str]) -> str:
        direction = self._direction(peer, sending)
        return f"{kind}:{direction}" if kind else direction

    def _send_meta(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        with self.ledger.tag("meta"):
            super()._send_meta(tensor, to_rank=to_rank, tag=tag)

    def _recv_meta(self, from_rank: int, tag: int) -> P2PTensorMetaData:
        with self.ledger.tag("meta"):
            meta = super()._recv_meta(from_rank=from_rank, tag=tag)
        if meta.is_contiguous:
            self._received_widths.append(None)
            return meta
        # a narrowed wire: receive its columns contiguously, remember the full width (the view's row stride)
        shape = tuple(int(n) for n in meta.shape)
        self._received_widths.append(int(meta.stride[-2]))
        nbytes = math.prod(shape) * torch.empty((), dtype=meta.dtype).element_size()
        return dataclasses.replace(meta, stride=_contiguous_strides(shape), is_contiguous=True,
                                   untyped_storage_size=nbytes, storage_offset=0)

    def isend_tensors(self, tensors: List[torch.Tensor], to_rank: int, tag: int = 0,
                      kind: Optional[str] = None) -> List[dist.Work]:
        # nanotron sends a non-contiguous tensor's whole storage; send exactly the tensor instead
        views = [_narrowed(t) for t in tensors]
        payloads = [t.contiguous() if v is None else v.contiguous() for t, v in zip(tensors, views)]
        futures = []
        me = dist.get_rank(self.pg)
        if self.link is not None and self.link.delays(me, to_rank):
            if self.device.type == "cuda":
                # the host queues kernels ahead of the GPU: stamp the departure once the data exists,
                # else the emulated link starts sending before the tensor is computed
                torch.cuda.current_stream(self.device).synchronize()
            share = self.tp_pg.size() if self._sliced(to_rank, kind) else 1  # a slice per TP rank's link
            arrival = self.link.schedule_send(me, to_rank,
                                              sum(-(-t.numel() // share) * t.element_size() for t in payloads))
            # on the P2P's device: an NCCL group cannot send a CPU tensor
            clock = torch.tensor([arrival], dtype=torch.float64, device=self.device)
            with self.ledger.tag("link-clock"):
                futures.append(self._isend_raw(clock, to_rank, tag))
        with self.ledger.tag(self._tag(to_rank, sending=True, kind=kind)):
            for view, payload in zip(views, payloads):
                if self._sliced(to_rank, kind):  # the whole tensor's header, then this TP rank's slice
                    self._send_meta(payload if view is None else view, to_rank=to_rank, tag=tag)
                    futures.append(self._isend_raw(own_slice(payload, self.tp_pg), to_rank, tag))
                elif view is None:
                    futures += super().isend_tensors([payload], to_rank=to_rank, tag=tag)
                else:  # the view's header (its stride carries the full width), then only its columns
                    self._send_meta(view, to_rank=to_rank, tag=tag)
                    futures.append(self._isend_raw(payload, to_rank, tag))
        return futures

    def send_tensors(self, tensors: List[torch.Tensor], to_rank: int, tag: int = 0, kind: Optional[str] = None) -> None:
        for future in self.isend_tensors(tensors, to_rank=to_rank, tag=tag, kind=kind):
            future.wait()

    def recv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0,
                     kind: Optional[str] = None) -> List[torch.Tensor]:
        arrival = None
        if self.link is not None and self.link.delays(from_rank, dist.get_rank(self.pg)):
            clock = torch.empty(1, dtype=torch.float64, device=self.device)
            with self.ledger.tag("link-clock"):
                dist.recv(clock, src=dist.get_global_rank(self.pg, from_rank), group=self.pg, tag=tag)
            arrival = float(clock.item())
        if self._sliced(from_rank, kind):
            with self.ledger.tag(self._tag(from_rank, sending=False, kind=kind)):
                buffers = self._recv_sliced(num_tensors, from_rank, tag)
            futures = []
        else:
            buffers, futures = self.irecv_tensors(num_tensors, from_rank=from_rank, tag=tag, kind=kind)
        for future in futures:
            future.wait()
        if arrival is not None:
            self.link.wait_until(arrival)
        return [_widen(b) for b in buffers]

    def irecv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0,
                      kind: Optional[str] = None) -> Tuple[List[torch.Tensor], List[dist.Work]]:
        self._received_widths = []
        with self.ledger.tag(self._tag(from_rank, sending=False, kind=kind)):
            buffers, futures = super().irecv_tensors(num_tensors, from_rank=from_rank, tag=tag)
        for buffer, width in zip(buffers, self._received_widths):
            if width is not None:  # recv_tensors pads it once the data is in
                setattr(buffer, _FULL_WIDTH, width)
        return buffers, futures

    def _isend_raw(self, tensor: torch.Tensor, to_rank: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst=dist.get_global_rank(self.pg, to_rank), group=self.pg, tag=tag)
