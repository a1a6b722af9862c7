"""The shared subspace of Subspace Models: one orthonormal basis U (d x k) and the fixed token table
T_fixed (V x d), identical on every stage, TP rank and replica because both come from a seed.

One `SubspaceHub` exists per model: the model's SubspacePieces (pieces.py) creates it once per model
build and hands it to every piece it builds. Every module that needs U
(split embedding, codec encoders/decoders, constrained output projections) holds the hub as a
submodule, so U is one tensor that a Grassmann update changes for all of them at once, and U is saved
in every checkpoint shard as a buffer (T_fixed is rebuilt from the seed, see `SubspaceHub`).
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from nanotron_ext.config.schema import ModelConfig


def make_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U = Q of the QR decomposition of a seeded d x k standard Gaussian (fp32, orthonormal columns)."""
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0].float()


def make_fixed_embedding(vocab: int, d: int, seed: int, std: float) -> torch.Tensor:
    """T_fixed: a seeded V x d Gaussian table with std `std` (high rank, never trained)."""
    g = torch.Generator().manual_seed(seed + 1)  # a different stream from U's
    return torch.randn(vocab, d, generator=g) * std


class SubspaceHub(nn.Module):
    """Holds U (`basis`, persistent buffer) and T_fixed (`fixed`, non-persistent: rebuilt from
    model.subspace.seed, so checkpoints do not carry one V x d copy per module that shares it), plus the
    Grassmann step counter. Keeps plain-list references to the modules whose weights live in span(U), so a
    Grassmann update can move them onto the new basis (nanotron_ext.subspace.grassmann)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        sub = cfg.subspace
        std = cfg.init_std if sub.fixed_embedding_std is None else sub.fixed_embedding_std
        self.register_buffer("basis", make_basis(cfg.hidden_size, sub.width(cfg.hidden_size), sub.seed))
        # the adapted embedding (heterogeneous SparseLoCo) changes T_fixed during training: then it is state
        adapted = cfg.embedding.kind == "subspace_adapted"
        self.register_buffer("fixed", make_fixed_embedding(cfg.vocab_size, cfg.hidden_size, sub.seed, std),
                             persistent=adapted)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        # plain lists (not submodules: these modules hold the hub, a submodule link back would loop)
        self.low_rank_tables: List[nn.Module] = []  # split embeddings: T_S [V, k] in U coordinates
        self.constrained: List[nn.Module] = []  # output projections in span(U) (full weight or W_small)
        self.decoders: List[nn.Module] = []  # codec decoders that accumulate A = sum G^T G
        # False when another driver times the Grassmann updates (heterogeneous SparseLoCo: at outer syncs)
        self.grassmann_in_step = True

    @property
    def k(self) -> int:
        return self.basis.shape[1]

    def project(self, w: torch.Tensor) -> torch.Tensor:
        """U U^T w: the part of w's columns (dim 0 = d) inside span(U)."""
        u = self.basis.to(w.dtype)
        return u @ (u.T @ w)
