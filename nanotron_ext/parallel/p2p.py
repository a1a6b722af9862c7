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
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

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


class AccountedP2P(P2P):
    def __init__(self, pg: dist.ProcessGroup, device: torch.device, link: Optional[LinkEmulator] = None) -> None:
        super().__init__(pg=pg, device=device)
        self.link = link
        self.ledger = get_ledger()
        self._received_widths: List[Optional[int]] = []

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
            arrival = self.link.schedule_send(me, to_rank, sum(t.numel() * t.element_size() for t in payloads))
            # on the P2P's device: an NCCL group cannot send a CPU tensor
            clock = torch.tensor([arrival], dtype=torch.float64, device=self.device)
            with self.ledger.tag("link-clock"):
                futures.append(self._isend_raw(clock, to_rank, tag))
        with self.ledger.tag(self._tag(to_rank, sending=True, kind=kind)):
            for view, payload in zip(views, payloads):
                if view is None:
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
