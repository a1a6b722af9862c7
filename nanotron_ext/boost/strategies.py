"""TP strategies for low-rank Llamas (BOOST): "vanilla" and "btp" (bottleneck-aware TP).

vanilla: the residual stream is replicated and every factorised linear is one Megatron chunk: its
down factor (d -> r) column-parallel on r, its up factor (r -> out) row-parallel, an all-reduce on
[b, s, out] in the forward and one on the chunk input in the backward. Attention and SwiGLU run
replicated between the chunks (Table 6: 5bsd + 2bs*d_ff forward per block).

btp: the chunk is shifted by one factor: an up factor (r -> out) is column-parallel and the NEXT
down factor (in -> r) row-parallel, so the only collective of a chunk is the all-reduce of the
[b, s, r] latent (7bsr per block per pass). Every linear therefore maps feature-sharded input to
feature-sharded output: the residual stream stays sharded on d, attention runs on local heads,
SwiGLU on local d_ff, and the pre-norms sit inside chunks (online or sync, see
online_rmsnorm.py). A full-rank (untargeted) linear keeps that contract with a
row-parallel GEMM and a reduce-scatter of its output features.

Both strategies optionally group linears (model.boost.group_linears): first GEMMs that share an
input become one GEMM over concatenated weights, second GEMMs on distinct latents one torch.bmm per
set of equal weight shapes, and the collectives of a group become one call. With
model.boost.lowrank_checkpointing the collective-free part of every chunk runs under
torch.utils.checkpoint (non-reentrant), so only the chunk boundaries are kept and the re-forward
issues no collective. Under btp those boundaries are the r-wide latents (plus the d/tp residual
shard at each sub-layer input); under vanilla they are the replicated d-wide chunk outputs.

Parameters stay one pair of factors per linear (names independent of strategy and grouping, so
one checkpoint serves every layout); a grouped GEMM concatenates or stacks this rank's weight
slices on each call, a weight-sized copy next to an activation-sized GEMM.
"""
from __future__ import annotations

from typing import Dict

import torch
from nanotron import distributed as dist
from nanotron.parallel.sharded_parameters import (
    SplitConfig,
    mark_all_parameters_in_module_as_sharded,
)
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelEmbedding
from torch import nn

from nanotron_ext.boost.btp import (
    gather_features,
    split_features,
)
from nanotron_ext.boost.btp_sublayers import BTPMLP, BTPAttention
from nanotron_ext.boost.lowrank import (
    LatentRelay,
    lax_previous,
    linear_specs,
)
from nanotron_ext.boost.vanilla import VanillaAttention, VanillaMLP
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.tp_strategy import MegatronHead, MegatronStrategy, TPStrategy


# -- embedding and head under btp -----------------------------------------------------------------------
class HiddenShardedEmbedding(nn.Embedding):
    """Token table sharded on the hidden dim: each rank looks up its own d/tp columns, no collective."""

    def __init__(self, num_embeddings: int, embedding_dim: int, pg: dist.ProcessGroup) -> None:
        if embedding_dim % pg.size():
            raise ValueError(f"btp shards the embedding width {embedding_dim} over tp={pg.size()}")
        super().__init__(num_embeddings, embedding_dim // pg.size())
        mark_all_parameters_in_module_as_sharded(self, pg=pg, split_config=SplitConfig(split_dim=1))


class FeatureShardedEmbedding(TensorParallelEmbedding):
    """nanotron's vocab-sharded embedding whose output keeps this rank's d/tp features; used when the
    table is tied to the vocab-sharded head (the two must share one layout)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return split_features(super().forward(input_ids), self.pg)


class GatheredHead(MegatronHead):
    """Megatron's head (final norm, vocab-sharded projection) after gathering the sharded residual."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__(cfg, tp_pg)
        self.tp_pg = tp_pg

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states=gather_features(hidden_states, self.tp_pg))


# -- strategies -------------------------------------------------------------------------------------------
class _LowRankStrategy(TPStrategy):
    attention_cls: type
    mlp_cls: type

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__(cfg, tp_pg)
        if cfg.low_rank.kind == "none":
            raise ValueError(f"tp_strategy {self.__class__.__name__} needs model.low_rank.kind in svd/cola/lax")
        specs = linear_specs(cfg)
        # LaX gate/up <- o crosses from the attention module to the MLP module of the same layer
        self._relay_needed = any(prev == "o" for prev in lax_previous(specs, cfg.low_rank.kind).values())
        self._relays: Dict[int, LatentRelay] = {}

    # vanilla: the factor pairs have no single output weight to constrain (btp names its up factors below)
    output_projections = TPStrategy.output_projections

    def attention(self, layer_idx: int) -> nn.Module:
        relay = self._relays.setdefault(layer_idx, LatentRelay()) if self._relay_needed else None
        return self.attention_cls(self.cfg, self.tp_pg, relay_out=relay)

    def mlp(self, layer_idx: int) -> nn.Module:
        relay = self._relays.pop(layer_idx, None) if self._relay_needed else None
        if self._relay_needed and relay is None:
            raise RuntimeError(f"LaX: build attention({layer_idx}) before mlp({layer_idx})")
        return self.mlp_cls(self.cfg, self.tp_pg, relay_in=relay)


class VanillaStrategy(_LowRankStrategy, MegatronStrategy):
    """Low-rank model, Megatron TP applied per factorised linear; embedding and head as Megatron."""

    attention_cls, mlp_cls = VanillaAttention, VanillaMLP


class BTPStrategy(_LowRankStrategy):
    """Bottleneck-aware TP: residual stream sharded on d between blocks and across pipeline stages."""

    residual_sharded = True
    attention_cls, mlp_cls = BTPAttention, BTPMLP

    def embedding(self) -> nn.Module:
        if self.cfg.tie_embeddings:
            return FeatureShardedEmbedding(self.cfg.vocab_size, self.cfg.hidden_size, pg=self.tp_pg,
                                           mode=TensorParallelLinearMode.ALL_REDUCE)
        return HiddenShardedEmbedding(self.cfg.vocab_size, self.cfg.hidden_size, self.tp_pg)

    def head(self) -> nn.Module:
        return GatheredHead(self.cfg, self.tp_pg)

    def output_projections(self, attn: nn.Module, mlp: nn.Module) -> Dict[str, nn.Module]:
        """The linears whose output is the residual branch: a factorised o/down's UP factor (column-parallel,
        this rank's d/tp output features; whatever h the pair applies, up(h(.)) lies in up's column span), a
        full-rank one itself (row-parallel, all d output rows on every rank, reduce-scattered)."""
        return {key: getattr(mod, "up", mod) for key, mod in (("attn_out", attn.o_proj), ("mlp_down", mlp.down_proj))}
