"""Heterogeneous SparseLoCo ("Heterogeneous Low-Bandwidth Pre-Training of LLMs", sec. 2.3, 2.4): some DP
replicas run their pipeline with the subspace codec (nanotron_ext.subspace), the others uncompressed,
all inside one SparseLoCo outer loop.

- Per-replica model config (technique.SparseLoCoTechnique.replica_config, applied by the core's
  models.build.replica_config for dp_sync "sparseloco"): replicas listed in sparseloco.compressed_replicas
  get the subspace codec and constraint (parameterisation "projection": the full output weights, so every
  replica has the same parameter names and shapes and SparseLoCo can average them); every replica gets
  embedding.kind = subspace_adapted (T_S [V, d] trained + T_fixed [V, d] state). Subspace owns those keys
  (nanotron_ext.subspace.technique.heterogeneous_replica); the switches of Table 4 map onto them:
  weight_projection -> reproject, modified_adamw -> modified_adamw.
- Embedding adaptation (sec. 2.4, `split_`, `adapt_`): at start T_S = T U U^T, T_fixed = T - T U U^T;
  after every outer sync T_fixed += T_S - T_S U U^T, T_S <- T_S U U^T. The sum is unchanged and, as the
  synced T_S is identical on every replica, so is T_fixed: every replica starts each inner loop identical.
- Grassmann updates with one U shared by all replicas (`sparseloco.grassmann_every`, Table 4c): the
  compressed replicas' last codec decoders accumulate A = sum G^T G during the inner steps; at every
  outer sync that ends a multiple of grassmann_every inner steps, A is averaged over them (one world
  all-reduce; in the simulated mode over the in-process hubs), every replica takes the same new U
  (nanotron_ext.subspace.grassmann.grassmann_update without moving weights, which must stay identical
  across replicas), and embedding adaptation then re-splits the synced table on the new U.
- `HeteroHook` runs the Grassmann update and the adaptation at "after_sync" in both drivers (SparseLoCoSync,
  SimulatedReplicas) and copies T_fixed from the embedding's stage to the later stages of a compressed pipeline (their codec
  decoders rebuild X = Z U^T + T_fixed[ids]): one dense V x d broadcast over the replica's pp group per
  outer sync, not counted in the SparseLoCo payload (a cost of this implementation, once per H steps).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import Config
from nanotron_ext.subspace.basis import SubspaceHub
from nanotron_ext.subspace.embedding import AdaptedSplitEmbedding
from nanotron_ext.subspace.grassmann import grassmann_update
from nanotron_ext.subspace.pieces import hub_of


def find_embedding(model: nn.Module) -> Optional[AdaptedSplitEmbedding]:
    """This rank's adapted embedding (None on ranks without the first stage)."""
    return next((m for m in model.modules() if isinstance(m, AdaptedSplitEmbedding)), None)


@torch.no_grad()
def split_(emb: AdaptedSplitEmbedding, adaptation: bool) -> None:
    """Initial split of the standard table T (T_S as initialised): T_S = T U U^T, and T_fixed = T - T U U^T
    with adaptation; without it T_fixed stays the subspace package's seeded table (Table 4a 'without')."""
    t = emb.table.weight
    u = emb.hub.basis.to(t.dtype)
    in_span = (t @ u) @ u.T
    if adaptation:
        emb.hub.fixed.copy_(t - in_span)
    t.copy_(in_span)


@torch.no_grad()
def adapt_(emb: AdaptedSplitEmbedding) -> None:
    """After a sync: T_fixed += T_S - T_S U U^T; T_S <- T_S U U^T (eq. 3-4)."""
    t = emb.table.weight
    u = emb.hub.basis.to(t.dtype)
    in_span = (t @ u) @ u.T
    emb.hub.fixed.add_(t - in_span)
    t.copy_(in_span)


class HeteroHook:
    """ReplicaHook of heterogeneous SparseLoCo. `hubs[r]` / `embeddings[r]`: replica r's hub and embedding
    on this process (the distributed driver knows only its own replica; the simulated one knows all)."""

    def __init__(self, cfg: Config, hubs: Dict[int, SubspaceHub],
                 embeddings: Dict[int, Optional[AdaptedSplitEmbedding]],
                 pp_pg: Optional[dist.ProcessGroup] = None, syncs: Optional[Callable[[], int]] = None) -> None:
        """`syncs()`: outer syncs done so far, the one just applied included (the driver's SparseLoCoOuter.syncs)."""
        self.cfg, self.hubs, self.embeddings, self.pp_pg, self.syncs = cfg, hubs, embeddings, pp_pg, syncs
        for hub in hubs.values():
            hub.grassmann_in_step = False  # updates happen at outer syncs, for all replicas at once

    def start(self, replica: int) -> None:
        """The initial split (every replica computes the same one from the same initial T)."""
        emb = self.embeddings[replica]
        if emb is not None:
            split_(emb, self.cfg.sparseloco.embedding_adaptation)
        self._share_fixed(replica)

    def __call__(self, replica: int, params: Sequence[torch.Tensor], moment: str) -> None:
        if moment != "after_sync":
            return
        if replica == min(self.hubs) and self._grassmann_due():  # once per sync, before any replica adapts
            grassmann_update(list(self.hubs.values()), move_weights=False)
        if not self.cfg.sparseloco.embedding_adaptation:
            return
        emb = self.embeddings[replica]
        if emb is not None:
            adapt_(emb)
        self._share_fixed(replica)

    def _grassmann_due(self) -> bool:
        every = self.cfg.sparseloco.grassmann_every
        if not every or self.syncs is None:
            return False
        return self.syncs() * self.cfg.sparseloco.inner_steps % every == 0

    def _share_fixed(self, replica: int) -> None:
        # later stages of a compressed pipeline decode with T_fixed: take the embedding stage's copy
        if self.pp_pg is None or self.pp_pg.size() == 1 or replica not in self.cfg.sparseloco.compressed_replicas:
            return
        dist.broadcast(self.hubs[replica].fixed, src=dist.get_global_rank(self.pp_pg, 0), group=self.pp_pg)


def hetero_hook(cfg: Config, models: Dict[int, nn.Module], pp_pg: Optional[dist.ProcessGroup] = None,
                syncs: Optional[Callable[[], int]] = None) -> HeteroHook:
    """The hook for replicas `models` (replica -> this process's model of it), each built from its replica
    config (models.build.replica_config), with the initial split done; `syncs` as in HeteroHook."""
    hubs = {r: hub_of(m) for r, m in models.items()}
    hook = HeteroHook(cfg, hubs, {r: find_embedding(m) for r, m in models.items()}, pp_pg, syncs)
    for r in models:
        hook.start(r)
    return hook
