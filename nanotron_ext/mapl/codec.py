"""MAPL's boundary codec: a learned Stiefel projection A_p and an anchor embedding per boundary.

    anchor_p(ids) = E_small_p[ids] P_p          E_small_p [V, m] trainable, P_p [m, d] fixed, orthonormal rows
    sender:    Z = (X - anchor_p(ids)) A_p      A_p [d, r], A_p^T A_p = I; only Z and the ids cross
    receiver:  X' = Z A_p^T + anchor_p(ids)

Z crosses in the run's compute dtype (codecs/base.wire_dtype), the ids as int32.

Both sides of boundary p hold identical copies of A_p and E_small_p (same seeded init, same gradient,
same deterministic optimiser step); "Learned Subspace Compression for Communication-Efficient Pipeline
Parallelism" (arXiv:2606.05484, sec. "Factorized Anchor Embeddings") says only Z and the token ids
cross, and does not say how the copies are kept equal. What must cross for exact copies
(`model.codec.mapl.shared_sync`, nanotron_ext/mapl/sync.py):
- "rows" (default): the receiver owns the anchor table's gradient. The sender's part of it,
  -(dL/dZ) A^T P^T per token, is computable on the receiver (it has dL/dZ = G A), so the decoder adds
  it through a term that is zero forward (`_sender_anchor_term`) and the encoder reads a detached table.
  After the backward the receiver sends the gradient rows of the ids this step touched (both sides
  know them: the ids cross with Z), in the wire dtype, no indices: U m values for U distinct ids instead
  of V m. A's gradient has a part on each side ((X - anchor)^T dL/dZ needs X, G^T Z needs G), so the two
  d x r partials are swapped, in the wire dtype. Per boundary per step: d r forward, d r + U m backward.
- "dense": each side's full fp32 gradients of A_p and E_small_p swapped and summed, (d r + V m) x 4 B
  each way (this codebase's earlier protocol, kept for comparison).
Both go through the pipeline's P2P (emulated links delay them; ledger op `send:codec_grads:fwd|bwd`).
Both sides then hold bit-identical gradients (tests/test_mapl.py at PP = 2).

Choices the text leaves open (config `model.codec.mapl`): r (default d/4, the paper's r = 256 at
d = 1024), anchor width m (default r), A_p = QR of a seeded Gaussian, E_small_p starts at zero (the
codec starts as a plain projection).

On a residual stream sharded over TP (BOOST's `model.tp_strategy: btp`: TP rank t holds the features S_t, d/tp
of them; `feature_shard`) no d-wide activation is all-gathered, because Z is a sum over feature shards:
    Z = (X - anchor(ids)) A = sum_t (X_{S_t} - E_small[ids] P[:, S_t]) A[S_t]      (A[S_t]: the rows S_t of A)
so each TP rank multiplies its shard by its rows of A and ONE all-reduce of the r-wide partial Z in the TP
group completes it (mbs seq r fp32 values per micro-batch; backward: identity). The wire is then the same on every
TP rank (`wire_replicated`: the pipeline sends it once, 1/tp from each TP rank), so RVQ quantises the whole Z,
and its sender's k-means step and streamed codebook rows are the same computation on every TP rank. The
receiver is column-parallel: X'_{S_t} = Z A[S_t]^T + E_small[ids] P[:, S_t], no forward communication;
backward, dZ = sum_t dX'_{S_t} A[S_t], one all-reduce of the r-wide dZ (nanotron's differentiable_identity).
Pipeline bytes per boundary are those of the replicated stream at any tp.
Where A_p and E_small_p live under TP: whole and REPLICATED on every TP rank (SPEL's retraction polar(A - lr D)
needs all of A), each rank using its rows S_t, so each rank's gradients are partial sums over the feature shards;
after the backward each side all-reduces them over TP in one flat buffer (sync.py: d r, + V m for a table whose
gradient is taken there), after which every TP rank holds the whole gradient and takes the identical optimiser
step. They stay plain (not nanotron-sharded) parameters, so global-norm clipping counts them once, on TP rank 0
(nanotron_ext/optim/clip.py), and every rank's checkpoint file holds the same copy. The copies' exchange across
the pipeline link then crosses it once, 1/tp from each TP rank (sync.py).
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
    differentiable_all_reduce_sum,
    differentiable_identity,
)
from torch import nn

from nanotron_ext.codecs.base import (
    BoundaryCodec,
    BoundaryDecoder,
    BoundaryEncoder,
    feature_shard,
    from_wire,
    residual_float,
    to_wire,
    wire_dtype,
)
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.mapl.rvq import ResidualQuantizer, decode_from_wire, encode_to_wire
from nanotron_ext.mapl.sync import sync_boundaries
from nanotron_ext.mapl.technique import SPEL_TAG
from nanotron_ext.models.init import SelfInitialising
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.optim.param_groups import mark_embedding_table, tag_parameter


def boundary_generator(seed: int, boundary: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"mapl.{boundary}.{what}".encode())) % 2**62)


class BoundaryProjection(SelfInitialising, nn.Module):
    """One side's copy of boundary p's state: A [d, r] (SPEL), anchor table [V, m], anchor basis [m, d]."""

    def __init__(self, cfg: ModelConfig, boundary: int) -> None:
        super().__init__()
        r, m = cfg.codec.mapl.widths(cfg.hidden_size)
        self.boundary = boundary
        self.A = nn.Parameter(torch.empty(cfg.hidden_size, r))
        tag_parameter(self.A, SPEL_TAG)
        self.anchor_table = nn.Parameter(torch.empty(cfg.vocab_size, m))
        mark_embedding_table(self.anchor_table)  # AdamW like every embedding (the paper's hybrid optimiser)
        self.register_buffer("anchor_basis", torch.empty(m, cfg.hidden_size))  # fixed, saved with the model

    @torch.no_grad()
    def init_own_parameters_(self, seed: int) -> None:
        """Identical on both sides: seeded by (seed, boundary), not by the parameter's name."""
        d, r = self.A.shape
        m = self.anchor_table.shape[1]
        self.A.copy_(torch.linalg.qr(torch.randn(d, r, generator=boundary_generator(seed, self.boundary, "A")))[0])
        basis = torch.linalg.qr(torch.randn(d, m, generator=boundary_generator(seed, self.boundary, "P")))[0]
        self.anchor_basis.copy_(basis.T)
        self.anchor_table.zero_()

    def anchor(self, input_ids: torch.Tensor, detach: bool = False, mine: slice = slice(None)) -> torch.Tensor:
        """The anchor's features `mine` (this TP rank's on a sharded stream): E_small[ids] P[:, mine]."""
        table = self.anchor_table.detach() if detach else self.anchor_table
        return table[input_ids] @ self.anchor_basis[:, mine]

    def sender_anchor_term(self, input_ids: torch.Tensor, mine: slice = slice(None)) -> torch.Tensor:
        """Zero [.., r] whose gradient, for an upstream gradient dL/dZ, is -(dL/dZ) (P A)^T = -(dL/dZ) A^T P^T
        on E_small[ids]: the sender's share of the anchor table's gradient, taken on the receiver. On a sharded
        stream each TP rank takes its shard's part, P[:, mine] A[mine] (summed over TP after the backward)."""
        e = self.anchor_table[input_ids]
        return (e - e.detach()) @ (self.anchor_basis[:, mine] @ self.A[mine]).detach()


class _Side(SelfInitialising, nn.Module):
    """One side of a boundary: its copy of the projection and, with RVQ, its quantiser."""

    def __init__(self, cfg: ModelConfig, boundary: int, sharded_pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        mapl = cfg.codec.mapl
        self.projection = BoundaryProjection(cfg, boundary)
        self.sharded_pg = sharded_pg  # the TP group the residual stream is sharded over (None: replicated)
        self.mine = feature_shard(sharded_pg, cfg.hidden_size)  # this TP rank's features S_r
        self.r, self.grad_bits = mapl.widths(cfg.hidden_size)[0], mapl.grad_bits
        self.quantizer = (ResidualQuantizer(self.r, mapl.vq_groups, mapl.vq_rounds, mapl.vq_codebook, mapl.vq_decay)
                          if mapl.vq_groups else None)
        self.codebook_scale = cfg.init_std
        self.wire_dtype = wire_dtype(cfg)
        self.shared_sync = mapl.shared_sync
        self.step_ids: List[torch.Tensor] = []  # the ids of this step's training micro-batches (sync.py)

    def record_ids(self, input_ids: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # a training forward (validation runs under no_grad)
            self.step_ids.append(input_ids.detach().reshape(-1))

    def touched_rows(self) -> torch.Tensor:
        """The distinct ids of this step's micro-batches, ascending (the same on both sides of the boundary)."""
        if not self.step_ids:
            return torch.empty(0, dtype=torch.long, device=self.projection.A.device)
        return torch.unique(torch.cat(self.step_ids))

    def init_own_parameters_(self, seed: int) -> None:
        self.projection.init_own_parameters_(seed)
        if self.quantizer is not None:
            gen = boundary_generator(seed, self.projection.boundary, "codebooks")
            self.quantizer.init_codebooks_(gen, self.codebook_scale)


class MaplEncoder(_Side, BoundaryEncoder):
    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        p, mine = self.projection, self.mine
        self.record_ids(input_ids)
        # "rows": the receiver takes this side's share of the anchor gradient (sender_anchor_term)
        z = (residual + branch - p.anchor(input_ids, detach=self.shared_sync == "rows", mine=mine)) @ p.A[mine]
        if self.sharded_pg is not None:
            # sum over the feature shards, in fp32 (autocast made the partials bf16)
            z = differentiable_all_reduce_sum(z.float(), group=self.sharded_pg)
        if self.quantizer is None:
            return to_wire(z, self.wire_dtype)
        return encode_to_wire(self.quantizer, z, self.grad_bits, learn=self.training, dtype=self.wire_dtype)


class MaplDecoder(_Side, BoundaryDecoder):
    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        p, mine = self.projection, self.mine
        self.record_ids(input_ids)
        z = from_wire(wire) if self.quantizer is None else decode_from_wire(self.quantizer, wire,
                                                                            self.r, self.grad_bits)
        if self.shared_sync == "rows":  # before the identity below: its gradient is the whole dL/dZ
            z = z - p.sender_anchor_term(input_ids, mine)  # zero forward; routes -dL/dZ A^T P^T to this table
        if self.sharded_pg is not None:
            z = differentiable_identity(z, group=self.sharded_pg)  # backward: dZ summed over the feature shards
        # fp32 (autocast: bf16 products)
        x = residual_float(z @ p.A[mine].T) + residual_float(p.anchor(input_ids, mine=mine))
        return x, x


class MaplCodec(BoundaryCodec):
    needs_token_ids = True

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, strategy: TPStrategy) -> None:
        super().__init__(cfg, tp_pg)
        self.sharded_pg = tp_pg if strategy.residual_sharded and tp_pg.size() > 1 else None

    def wire_replicated(self, residual_sharded: bool) -> bool:
        return True  # Z is all-reduced over TP on a sharded stream, and computed alike on a replicated one

    def encoder(self, boundary: int) -> BoundaryEncoder:
        return MaplEncoder(self.cfg, boundary, self.sharded_pg)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return MaplDecoder(self.cfg, boundary, self.sharded_pg)

    @torch.no_grad()
    def after_backward(self, encoders: Dict[int, BoundaryEncoder], decoders: Dict[int, BoundaryDecoder],
                       p2p: P2P) -> None:
        """Make both copies of each boundary's A_p and E_small_p gradients equal (module doc, sync.py)."""
        sync_boundaries(encoders, decoders, p2p)
