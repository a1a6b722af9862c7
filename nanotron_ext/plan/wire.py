"""Pipeline messages between planned ranks: their headers cross for real, their data does not.

Over the fake process group (torch.testing._internal.distributed.fake_pg) every send and receive is a no-op,
so a receiver learns nothing; but nanotron's P2P sends each tensor's header (two small long tensors: ndim,
dtype, ..., then shape and stride) before its data, and the receiver sizes its buffer from it. A planned
pipeline runs one process per stage: `plannable` makes the model's P2P post each header to a real key-value
store (torch's TCPStore, hosted by the planner) besides making the fake sends, and a receiver takes the header
from the store, then makes the same fake receives a real rank makes. The ledger therefore counts every header
and data byte as a real run does, and each stage computes on (meta) tensors of the shapes its neighbours
really send, in the order the pipeline engine sends them (activations, gradients, a codec's own exchanges).
"""
from __future__ import annotations

import json
from typing import Dict

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import (
    DTYPE_TO_ID,
    FIRST_METADATA_SIZE,
    ID_TO_DTYPE,
    ID_TO_IS_CONTIGUOUS,
    ID_TO_REQUIRES_GRAD,
    IS_CONTIGUOUS_TO_ID,
    P2P,
    REQUIRES_GRAD_TO_ID,
    SECOND_METADATA_SIZE,
    P2PTensorMetaData,
)
from nanotron.utils import get_untyped_storage

from nanotron_ext.parallel.p2p import AccountedP2P


class _HeaderP2P(P2P):
    """nanotron's header exchange, with the header posted to / taken from `store` (keyed by the global sender,
    receiver and the message's number between them: both sides number their messages in program order)."""

    store: torch.distributed.Store
    _numbered: Dict[str, int]

    def _key(self, src: int, dst: int) -> str:
        pair = f"{dist.get_global_rank(self.pg, src)}->{dist.get_global_rank(self.pg, dst)}"
        n = self._numbered[pair] = self._numbered.get(pair, 0) + 1
        return f"header/{pair}/{n}"

    def _send_meta(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        first = [len(tensor.shape), len(tensor.stride()), IS_CONTIGUOUS_TO_ID[tensor.is_contiguous()],
                 get_untyped_storage(tensor).size(), tensor.storage_offset(), DTYPE_TO_ID[tensor.dtype],
                 REQUIRES_GRAD_TO_ID[tensor.requires_grad]]
        header = json.dumps([first, [*tensor.shape, *tensor.stride()]])
        self.store.set(self._key(dist.get_rank(self.pg), to_rank), header)
        super()._send_meta(tensor, to_rank=to_rank, tag=tag)  # the (fake) sends the ledger counts

    def _recv_meta(self, from_rank: int, tag: int) -> P2PTensorMetaData:
        first, second = json.loads(self.store.get(self._key(from_rank, dist.get_rank(self.pg))))
        src = dist.get_global_rank(self.pg, from_rank)
        dist.recv(self.first_metadata, src=src, group=self.pg, tag=tag)  # the receives nanotron makes
        dist.recv(torch.empty(len(second), dtype=torch.long), src=src, group=self.pg, tag=tag)
        ndim = first[0]
        return P2PTensorMetaData(shape=second[:ndim], stride=second[ndim:], is_contiguous=ID_TO_IS_CONTIGUOUS[first[2]],
                                 untyped_storage_size=first[3], storage_offset=first[4], dtype=ID_TO_DTYPE[first[5]],
                                 requires_grad=ID_TO_REQUIRES_GRAD[first[6]])


class PlannedP2P(AccountedP2P, _HeaderP2P):
    """AccountedP2P (ledger tags, wire narrowing, TP scatter-gather, emulated links) over `_HeaderP2P`."""


def plannable(p2p: AccountedP2P, store: torch.distributed.Store) -> PlannedP2P:
    """Turn the model's P2P (built by build_model) into a PlannedP2P in place, so every block holding it follows.
    Its header buffers live on the CPU: nanotron reads them back (an assert), which a meta tensor cannot do."""
    p2p.__class__ = PlannedP2P
    p2p.store, p2p._numbered = store, {}
    p2p.first_metadata = torch.empty(FIRST_METADATA_SIZE, dtype=torch.long)
    p2p.second_metadata = torch.empty(SECOND_METADATA_SIZE, dtype=torch.long)
    return p2p  # type: ignore[return-value]
