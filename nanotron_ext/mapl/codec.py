"""MAPL's boundary codec: a learned Stiefel projection A_p and an anchor embedding per boundary.

    anchor_p(ids) = E_small_p[ids] P_p          E_small_p [V, m] trainable, P_p [m, d] fixed, orthonormal rows
    sender:    Z = (X - anchor_p(ids)) A_p      A_p [d, r], A_p^T A_p = I; only Z and the ids cross
    receiver:  X' = Z A_p^T + anchor_p(ids)

Both sides of boundary p hold identical copies of A_p and E_small_p (same seeded init, same summed
gradient, same deterministic optimiser step). `after_backward` sums each copy's gradient with the
other side's: locally when both sides share a process, else by one exchange with the neighbouring
stage (counted in the ledger as pp `send:codec_grads`; (d r + V m) x 4 bytes per boundary per step
each way). The MAPL text does not say how its copies are kept equal; this is exact and simple.

Choices the text leaves open (config `model.codec.mapl`): r (default d/4, the paper's r = 256 at
d = 1024), anchor width m (default r), A_p = QR of a seeded Gaussian, E_small_p starts at zero (the
codec starts as a plain projection). The residual stream must be replicated over TP (not `btp`).
"""
from __future__ import annotations

import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder
from nanotron_ext.config.checks import ConfigError
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.mapl.rvq import ResidualQuantizer, decode_from_wire, encode_to_wire
from nanotron_ext.mapl.technique import SPEL_TAG
from nanotron_ext.models.init import SelfInitialising
from nanotron_ext.models.tp_strategy import TPStrategy
from nanotron_ext.optim.param_groups import mark_embedding_table, tag_parameter
from nanotron_ext.parallel.comm import get_ledger


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

    def anchor(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.anchor_table[input_ids] @ self.anchor_basis


class _Side(SelfInitialising, nn.Module):
    """One side of a boundary: its copy of the projection and, with RVQ, its quantiser."""

    def __init__(self, cfg: ModelConfig, boundary: int) -> None:
        super().__init__()
        mapl = cfg.codec.mapl
        self.projection = BoundaryProjection(cfg, boundary)
        self.r, self.grad_bits = mapl.widths(cfg.hidden_size)[0], mapl.grad_bits
        self.quantizer = (ResidualQuantizer(self.r, mapl.vq_groups, mapl.vq_rounds, mapl.vq_codebook, mapl.vq_decay)
                          if mapl.vq_groups else None)
        self.codebook_scale = cfg.init_std

    def init_own_parameters_(self, seed: int) -> None:
        self.projection.init_own_parameters_(seed)
        if self.quantizer is not None:
            gen = boundary_generator(seed, self.projection.boundary, "codebooks")
            self.quantizer.init_codebooks_(gen, self.codebook_scale)


class MaplEncoder(_Side, BoundaryEncoder):
    def forward(self, residual: torch.Tensor, branch: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        p = self.projection
        z = (residual + branch - p.anchor(input_ids)) @ p.A
        if self.quantizer is None:
            return z
        return encode_to_wire(self.quantizer, z, self.grad_bits, learn=self.training)


class MaplDecoder(_Side, BoundaryDecoder):
    def forward(self, wire: torch.Tensor, input_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        p = self.projection
        z = wire if self.quantizer is None else decode_from_wire(self.quantizer, wire, self.r, self.grad_bits)
        x = z @ p.A.T + p.anchor(input_ids)
        return x, x


def _grads(module: nn.Module) -> List[torch.Tensor]:
    grads = []
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a side that saw no micro-batch still takes part in the sum
        grads.append(p.grad)
    return grads


class MaplCodec(BoundaryCodec):
    needs_token_ids = True

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup, strategy: TPStrategy) -> None:
        super().__init__(cfg, tp_pg)
        if strategy.residual_sharded:
            raise ConfigError(f"model.codec.kind='mapl' needs the residual stream replicated over TP; "
                              f"model.tp_strategy={cfg.tp_strategy!r} shards it")

    def encoder(self, boundary: int) -> BoundaryEncoder:
        return MaplEncoder(self.cfg, boundary)

    def decoder(self, boundary: int) -> BoundaryDecoder:
        return MaplDecoder(self.cfg, boundary)

    @torch.no_grad()
    def after_backward(self, encoders: Dict[int, BoundaryEncoder], decoders: Dict[int, BoundaryDecoder],
                       pp_pg: dist.ProcessGroup) -> None:
        """Sum the gradients of the two copies of each boundary's state (see module doc)."""
        me = dist.get_rank(pp_pg)
        for boundary, sides in _by_boundary(encoders, decoders):
            mine = [_grads(s.projection) for s in sides]
            if len(mine) == 2:  # both sides on this process
                for g_enc, g_dec in zip(*mine):
                    g_enc.add_(g_dec)
                    g_dec.copy_(g_enc)
                continue
            peer_stage = me + 1 if boundary in encoders else me - 1
            flat = torch.cat([g.reshape(-1) for g in mine[0]])
            theirs = torch.empty_like(flat)
            peer = dist.get_global_rank(pp_pg, peer_stage)
            with get_ledger().tag("codec_grads"):
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, peer, group=pp_pg),
                                                    dist.P2POp(dist.irecv, theirs, peer, group=pp_pg)]):
                    work.wait()
            # the same sum on both sides, in the same order (sender's + receiver's): bit-identical copies
            total = flat + theirs if boundary in encoders else theirs + flat
            offset = 0
            for g in mine[0]:
                g.copy_(total[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _by_boundary(encoders: Dict[int, BoundaryEncoder],
                 decoders: Dict[int, BoundaryDecoder]) -> Iterator[Tuple[int, List[nn.Module]]]:
    """Boundaries in increasing order (the exchange order both stages agree on), with this rank's sides."""
    for b in sorted(set(encoders) | set(decoders)):
        yield b, [s for s in (encoders.get(b), decoders.get(b)) if s is not None]
