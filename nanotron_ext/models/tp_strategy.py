"""Tensor-parallel layouts of the Llama family: the extension point for BOOST's strategies.

A `TPStrategy` builds the four per-rank pieces a Llama needs, already sharded for its TP group:

    embedding()        input_ids [b, s]             -> hidden [b, s, d_local]
    attention(i)       hidden (pre-norm included)   -> attention branch, same layout as hidden
    mlp(i)             hidden (pre-norm included)   -> MLP branch
    head()             hidden_states= (final norm included) -> vocab-sharded logits [b, s, V / tp]

`d_local` is d when the residual stream is replicated across TP ranks (Megatron), d / tp when it
is sharded (BOOST's bottleneck-aware TP, nanotron_ext.boost). `model.tp_strategy` names one; the
technique that provides the name builds it (nanotron_ext.technique.Pieces.tp_strategy; megatron is the
core's, nanotron_ext.models.pieces.CorePieces).
"""
from __future__ import annotations

from typing import Dict

import torch
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
)
from torch import nn

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.layers import RMSNorm, RotaryEmbedding, causal_attention


class TPStrategy:
    residual_sharded: bool = False
    """True when the residual stream between blocks is sharded on d across TP ranks."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        self.cfg = cfg
        self.tp_pg = tp_pg
        self.tp = tp_pg.size()

    def embedding(self) -> nn.Module:
        raise NotImplementedError

    def attention(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def mlp(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def head(self) -> nn.Module:
        raise NotImplementedError

    def output_projections(self, attn: nn.Module, mlp: nn.Module) -> Dict[str, nn.Module]:
        """The linears that write into the residual stream: {"attn_out": ..., "mlp_down": ...}, for
        model.output_constraint."""
        raise NotImplementedError(
            f"model.tp_strategy={self.cfg.tp_strategy!r} does not expose its output projections, "
            "which model.output_constraint needs; use tp_strategy 'megatron'")


class MegatronAttention(nn.Module):
    """Pre-norm GQA attention: fused column-parallel qkv (heads sharded), row-parallel output."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        tp, hd = tp_pg.size(), cfg.head_dim
        mode = TensorParallelLinearMode.ALL_REDUCE
        self.n_q, self.n_kv, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, hd
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        # one column linear for q, k and v: one all-reduce of the input gradient instead of three
        self.qkv_proj = TensorParallelColumnLinear(
            cfg.hidden_size, q_out + 2 * kv_out, pg=tp_pg, mode=mode, bias=False,
            contiguous_chunks=(q_out, kv_out, kv_out),
        )
        self.o_proj = TensorParallelRowLinear(q_out, cfg.hidden_size, pg=tp_pg, mode=mode, bias=False)
        # one qk-norm weight serves every head, and each TP rank holds different heads
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, shared_across=tp_pg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, shared_across=tp_pg) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(hd, cfg.max_seq_len, cfg.rope_theta)
        self.backend = cfg.attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv_proj(self.norm(x))
        q, k, v = qkv.split([self.n_q * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1)
        q = q.view(b, s, self.n_q, self.head_dim)
        k = k.view(b, s, self.n_kv, self.head_dim)
        v = v.view(b, s, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = causal_attention(self.rotary(q), self.rotary(k), v, self.backend)
        return self.o_proj(out.reshape(b, s, self.n_q * self.head_dim))


class MegatronMLP(nn.Module):
    """Pre-norm SwiGLU: fused column-parallel gate/up, row-parallel down."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        mode = TensorParallelLinearMode.ALL_REDUCE
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = TensorParallelColumnLinear(
            cfg.hidden_size, 2 * cfg.ffn_size, pg=tp_pg, mode=mode, bias=False,
            contiguous_chunks=(cfg.ffn_size, cfg.ffn_size),
        )
        self.down_proj = TensorParallelRowLinear(cfg.ffn_size, cfg.hidden_size, pg=tp_pg, mode=mode, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(self.norm(x)).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class MegatronHead(nn.Module):
    """Final RMSNorm and the vocab-sharded output projection."""

    def __init__(self, cfg: ModelConfig, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = TensorParallelColumnLinear(
            cfg.hidden_size, cfg.vocab_size, pg=tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE, bias=False
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(hidden_states))


class MegatronStrategy(TPStrategy):
    """Full-rank Megatron TP: residual replicated, one all-reduce per sub-layer per pass (2bsd per block)."""

    def embedding(self) -> nn.Module:
        return TensorParallelEmbedding(
            self.cfg.vocab_size, self.cfg.hidden_size, pg=self.tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE
        )

    def attention(self, layer_idx: int) -> nn.Module:
        return MegatronAttention(self.cfg, self.tp_pg)

    def mlp(self, layer_idx: int) -> nn.Module:
        return MegatronMLP(self.cfg, self.tp_pg)

    def head(self) -> nn.Module:
        return MegatronHead(self.cfg, self.tp_pg)

    def output_projections(self, attn: nn.Module, mlp: nn.Module) -> Dict[str, nn.Module]:
        return {"attn_out": attn.o_proj, "mlp_down": mlp.down_proj}


class TiedEmbedding:
    """An embedding that is not one table (e.g. Subspace Models' split table) and ties the head itself."""

    def tie_head(self, head: nn.Module) -> None:
        raise NotImplementedError


def tie_head_to_embedding(head: nn.Module, embedding: nn.Module) -> None:
    """Share one parameter between head and embedding: both are vocab-sharded on dim 0 over TP. A
    `TiedEmbedding` (not one table) ties the head itself."""
    if isinstance(embedding, TiedEmbedding):
        embedding.tie_head(head)
        return
    if not isinstance(getattr(embedding, "weight", None), nn.Parameter):
        raise ValueError(f"model.tie_embeddings needs an embedding with one table (.weight); "
                         f"model.embedding.kind built a {type(embedding).__name__}")
    head.lm_head.weight = embedding.weight
