"""Pipeline point-to-point with byte accounting and optional link emulation.

Subclasses nanotron's P2P, which both pipeline engines use through `send_tensors` /
`recv_tensors`. Data messages are recorded as `send:fwd` / `recv:fwd` (to a later stage:
activations) or `send:bwd` / `recv:bwd` (to an earlier stage: gradients); nanotron's shape and
dtype headers as `send:meta` / `recv:meta`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData

from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.link import LinkEmulator


class AccountedP2P(P2P):
    def __init__(self, pg: dist.ProcessGroup, device: torch.device, link: Optional[LinkEmulator] = None) -> None:
        super().__init__(pg=pg, device=device)
        self.link = link
        self.ledger = get_ledger()

    def _direction(self, peer: int, sending: bool) -> str:
        # activations flow to later stages: a send to a later stage or a recv from an earlier one is "fwd"
        peer_is_later = peer > dist.get_rank(self.pg)
        return "fwd" if peer_is_later == sending else "bwd"

    def _send_meta(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        with self.ledger.tag("meta"):
            super()._send_meta(tensor, to_rank=to_rank, tag=tag)

    def _recv_meta(self, from_rank: int, tag: int) -> P2PTensorMetaData:
        with self.ledger.tag("meta"):
            return super()._recv_meta(from_rank=from_rank, tag=tag)

    def isend_tensors(self, tensors: List[torch.Tensor], to_rank: int, tag: int = 0) -> List[dist.Work]:
        # nanotron sends a non-contiguous tensor's whole storage; send exactly the tensor instead
        tensors = [t.contiguous() for t in tensors]
        futures = []
        me = dist.get_rank(self.pg)
        if self.link is not None and self.link.delays(me, to_rank):
            if self.device.type == "cuda":
                # the host queues kernels ahead of the GPU: stamp the departure once the data exists,
                # else the emulated link starts sending before the tensor is computed
                torch.cuda.current_stream(self.device).synchronize()
            arrival = self.link.schedule_send(me, to_rank, sum(t.numel() * t.element_size() for t in tensors))
            # on the P2P's device: an NCCL group cannot send a CPU tensor
            clock = torch.tensor([arrival], dtype=torch.float64, device=self.device)
            with self.ledger.tag("link-clock"):
                futures.append(self._isend_raw(clock, to_rank, tag))
        with self.ledger.tag(self._direction(to_rank, sending=True)):
            return futures + super().isend_tensors(tensors, to_rank=to_rank, tag=tag)

    def recv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0) -> List[torch.Tensor]:
        arrival = None
        if self.link is not None and self.link.delays(from_rank, dist.get_rank(self.pg)):
            clock = torch.empty(1, dtype=torch.float64, device=self.device)
            with self.ledger.tag("link-clock"):
                dist.recv(clock, src=dist.get_global_rank(self.pg, from_rank), group=self.pg, tag=tag)
            arrival = float(clock.item())
        buffers, futures = self.irecv_tensors(num_tensors, from_rank=from_rank, tag=tag)
        for future in futures:
            future.wait()
        if arrival is not None:
            self.link.wait_until(arrival)
        return buffers

    def irecv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0) -> Tuple[List[torch.Tensor], List[dist.Work]]:
        with self.ledger.tag(self._direction(from_rank, sending=False)):
            return super().irecv_tensors(num_tensors, from_rank=from_rank, tag=tag)

    def _isend_raw(self, tensor: torch.Tensor, to_rank: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst=dist.get_global_rank(self.pg, to_rank), group=self.pg, tag=tag)
