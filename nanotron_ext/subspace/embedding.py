"""The split token embedding of Subspace Models (sec. 4.3.1): TE = T_fixed[ids] + T_S[ids] U^T.

T_fixed (V x d) is high rank, seeded and never trained (the hub's `fixed` buffer); T_S (V x k) is the
trainable low-rank part in U coordinates, so T_S U^T lies in span(U) and the codec can subtract
T_fixed[ids] and send k coordinates. Under TP, T_S is nanotron's vocab-sharded TensorParallelEmbedding
(its k-wide output is all-reduced) and T_fixed is replicated (a lookup, no communication).

On a residual stream sharded over TP (BOOST's btp: rank r holds the features S_r; Protocol Models,
arXiv:2506.01260, sec. 4.3.1 per feature shard) each rank embeds only its shard,
    X0_{S_r} = T_fixed[ids]_{S_r} + T_S[ids] U_{S_r}^T      (U_{S_r}: the rows S_r of U),
with T_S kept vocab-sharded exactly as under Megatron (the same parameter, names and shards at either
strategy, and the row-wise layout heterogeneous SparseLoCo's adaptation expects): the lookup's k-wide
all-reduce gives every rank the whole T_S[ids], and each multiplies it by its own rows of U. Backward, a
rank's dT_S[ids] = dX0_{S_r} U_{S_r} is its shard's part only, so the k-wide lookup output passes
nanotron's differentiable_identity (backward: all-reduce over TP) before the product; the lookup's own
backward then scatters the summed gradient into each rank's vocabulary rows. Communication per pass:
b*s*k each way (no d-wide collective). A tied head (btp gathers the residual before its vocab-sharded
head) reads the same table_shard() as under Megatron.

Tied heads (model.tie_embeddings, pp = 1 like every tied model here): the head reads the composed table,
logits = h (T_fixed + T_S U^T)^T over this TP rank's vocabulary rows, rebuilt from T_S at every forward
(`SplitEmbedding.tie_head`), so T_S is trained through both uses while T_fixed stays a seeded buffer,
identical everywhere, as the codec needs.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import differentiable_identity
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelEmbedding
from torch import nn

from nanotron_ext.codecs.base import feature_shard
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.dense import FullTensor
from nanotron_ext.models.init import local_shard
from nanotron_ext.models.tp_strategy import TiedEmbedding, TPStrategy
from nanotron_ext.subspace.basis import SubspaceHub


class SplitEmbedding(TiedEmbedding, nn.Module):
    """input_ids [b, s] -> T_fixed[ids] + T_S[ids] U^T, [b, s, d] (replicated over TP), or this rank's
    features [b, s, d / tp] of it when the strategy shards the residual stream (see module docstring)."""

    def __init__(self, cfg: ModelConfig, strategy: TPStrategy, hub: SubspaceHub) -> None:
        super().__init__()
        self.hub = hub
        self.sharded_pg = strategy.tp_pg if strategy.residual_sharded and strategy.tp_pg.size() > 1 else None
        # parameter name token_embedding.pp_block.embedding.small.weight: seeded like every other parameter
        self.small = TensorParallelEmbedding(cfg.vocab_size, hub.k, pg=strategy.tp_pg,
                                             mode=TensorParallelLinearMode.ALL_REDUCE)
        hub.low_rank_tables.append(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        low = self.small(input_ids)
        mine = feature_shard(self.sharded_pg, self.hub.basis.shape[0])
        if self.sharded_pg is not None:
            low = differentiable_identity(low, group=self.sharded_pg)  # backward: dT_S[ids] summed over the shards
        return self.hub.fixed[input_ids][..., mine].to(low.dtype) + low @ self.hub.basis[mine].to(low.dtype).T

    def table_shard(self) -> torch.Tensor:
        """T_fixed + T_S U^T on this TP rank's vocabulary rows [min_id, max_id) (the head's shard too)."""
        t_s = self.small.weight
        fixed = self.hub.fixed[self.small.min_id:self.small.max_id].to(t_s.dtype)
        return fixed + t_s @ self.hub.basis.to(t_s.dtype).T

    # nanotron_ext.models.dense.DenseEquivalent: the one token table T_fixed + T_S U^T
    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        table = self.hub.fixed.double().cpu() + full(self.small.weight).double() @ self.hub.basis.double().cpu().T
        return {"weight": table.float()}

    @torch.no_grad()
    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """T_S = (E - T_fixed) U, the closest composed table to E (T_fixed is seeded, not state); returns how much
        of E is lost, ||(E - T_fixed)(I - U U^T)|| / ||E||."""
        e = dense["weight"].double()
        u, fixed = self.hub.basis.double().cpu(), self.hub.fixed.double().cpu()
        small = (e - fixed) @ u
        self.small.weight.copy_(local_shard(small.float(), self.small.weight).to(self.small.weight.dtype))
        return {"weight": float((e - fixed - small @ u.T).norm() / e.norm().clamp_min(1e-30))}

    def tie_head(self, head: nn.Module) -> None:
        """Make the vocab-sharded output projection `head.lm_head` read table_shard(): its own weight is
        dropped and rebuilt before every forward (a fresh graph, so T_S gets the head's gradient)."""
        lin = head.lm_head
        if tuple(lin.weight.shape) != (self.small.max_id - self.small.min_id, self.hub.basis.shape[0]):
            raise ValueError(f"tied head shard {tuple(lin.weight.shape)} does not match the split table's")
        del lin._parameters["weight"]  # nn.Module keeps parameters in this dict; the weight is derived now
        lin.register_forward_pre_hook(lambda module, args: setattr(module, "weight", self.table_shard()))


def split_embedding(cfg: ModelConfig, strategy: TPStrategy, hub: SubspaceHub) -> nn.Module:
    """model.embedding.kind = subspace."""
    return SplitEmbedding(cfg, strategy, hub)


class AdaptedSplitEmbedding(nn.Module):
    """The split table of heterogeneous SparseLoCo (sec. 2.4), the same parameters on every replica:
    T_S [V, d] (`table.weight`, trained) and T_fixed [V, d] (the hub's `fixed`, a persistent buffer).
    A compressed replica (model.codec.kind = subspace) embeds T_fixed[ids] + T_S[ids] U U^T, so what its
    codec sends stays exact even while T_S drifts out of span(U) within an inner loop; an uncompressed
    replica embeds T_fixed[ids] + T_S[ids]. Embedding adaptation (nanotron_ext.sparseloco.hetero) keeps
    T_S in span(U) at the start of every inner loop, where both forms agree.

    Under (Megatron) TP, T_S is vocab-sharded like the standard table (nanotron's TensorParallelEmbedding:
    this rank's rows [min_id, max_id), the lookup all-reduced), T_fixed replicated: adaptation is row-wise in
    V, so each TP rank adapts its own rows of T_S and the TP group all-gathers what T_fixed gains. On a
    btp-sharded residual stream (`sharded_pg`) the table and its adaptation stay exactly so; the d-wide lookup
    (all-reduced like Megatron's) passes nanotron's differentiable_identity (backward: the shards' gradients,
    each zero outside its features, summed) and each rank keeps its features S_r."""

    def __init__(self, cfg: ModelConfig, hub: SubspaceHub, compressed: bool,
                 tp_pg: Optional[dist.ProcessGroup] = None, residual_sharded: bool = False) -> None:
        super().__init__()
        self.hub, self.compressed = hub, compressed
        self.sharded_pg = tp_pg if residual_sharded and tp_pg is not None and tp_pg.size() > 1 else None
        # init_weights_ draws it like a standard table (layout-independent: the same rows at any tp); without a
        # process group (unit tests, one process) a plain table
        self.table = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp_pg is None else TensorParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, pg=tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE)

    @property
    def tp_pg(self) -> Optional[dist.ProcessGroup]:
        return getattr(self.table, "pg", None)

    def local_rows(self) -> slice:
        """This TP rank's rows of the vocabulary (of T_S's shard and of the replicated T_fixed)."""
        return slice(getattr(self.table, "min_id", None), getattr(self.table, "max_id", None))

    def _composed(self, t_s: torch.Tensor) -> torch.Tensor:
        if self.compressed:
            u = self.hub.basis.to(t_s.dtype)
            t_s = (t_s @ u) @ u.T
        return self.hub.fixed.to(t_s.dtype) + t_s

    # nanotron_ext.models.dense.DenseEquivalent: the one token table this replica embeds with
    def dense_equivalent(self, full: FullTensor, exact: bool = True) -> Dict[str, torch.Tensor]:
        return {"weight": self._composed(full(self.table.weight).detach().double().cpu()).float()}

    @torch.no_grad()
    def load_dense_(self, dense: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """T_S = E - T_fixed (this TP rank's rows); a compressed replica embeds its span(U) part only."""
        e = dense["weight"].double()
        t_s = e - self.hub.fixed.double().cpu()
        self.table.weight.copy_(t_s[self.local_rows()].to(self.table.weight.dtype))
        return {"weight": float((self._composed(t_s) - e).norm() / e.norm().clamp_min(1e-30))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        low = self.table(input_ids)
        if self.compressed:
            u = self.hub.basis.to(low.dtype)
            low = (low @ u) @ u.T  # rows onto span(U): T_S[ids] U U^T
        x = self.hub.fixed[input_ids].to(low.dtype) + low
        if self.sharded_pg is None:
            return x
        return differentiable_identity(x, group=self.sharded_pg)[..., feature_shard(self.sharded_pg, x.shape[-1])]


def adapted_split_embedding(cfg: ModelConfig, strategy: TPStrategy, hub: SubspaceHub) -> nn.Module:
    """model.embedding.kind = subspace_adapted (untied: checked at config load)."""
    return AdaptedSplitEmbedding(cfg, hub, compressed=cfg.codec.kind == "subspace", tp_pg=strategy.tp_pg,
                                 residual_sharded=strategy.residual_sharded)
