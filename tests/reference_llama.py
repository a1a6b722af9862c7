"""An independent single-process Llama in plain torch, float64, for parity tests.

It shares no code with nanotron_ext's model: attention is an explicit masked softmax, RoPE is
written out, the loss is F.cross_entropy. Only the parameter names (the checkpoint format) and
the init function are shared, so both start from the same weights.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.models.init import full_init_tensor


def reference_param_shapes(cfg: ModelConfig) -> Dict[str, tuple]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    shapes = {"token_embedding.pp_block.embedding.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"decoder.{i}.pp_block"
        shapes.update({
            f"{p}.attn.norm.weight": (d,), f"{p}.attn.qkv_proj.weight": (qkv, d),
            f"{p}.attn.o_proj.weight": (d, cfg.num_heads * hd),
            f"{p}.mlp.norm.weight": (d,), f"{p}.mlp.gate_up_proj.weight": (2 * f, d),
            f"{p}.mlp.down_proj.weight": (d, f),
        })
        if cfg.qk_norm:
            shapes.update({f"{p}.attn.q_norm.weight": (hd,), f"{p}.attn.k_norm.weight": (hd,)})
    shapes["lm_head.pp_block.final_norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.pp_block.lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def params_from_shapes(cfg: ModelConfig, shapes: Dict[str, tuple], seed: int) -> Dict[str, torch.Tensor]:
    """Full float64 leaf tensors (requires_grad) initialised exactly like the sharded model."""
    return {
        name: full_init_tensor(name, torch.Size(shape), seed, cfg.init_std, cfg.num_layers).double().requires_grad_()
        for name, shape in shapes.items()
    }


def reference_params(cfg: ModelConfig, seed: int) -> Dict[str, torch.Tensor]:
    return params_from_shapes(cfg, reference_param_shapes(cfg), seed)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [b, s, h, hd]; rotate pairs (i, i + hd/2) by angle pos * theta^(-2i/hd)
    s, hd = x.shape[1], x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_loss(cfg: ModelConfig, params: Dict[str, torch.Tensor], input_ids: torch.Tensor, label_ids: torch.Tensor,
                   boundary: Optional[Callable[[int, torch.Tensor, torch.Tensor],
                                               torch.Tensor]] = None) -> torch.Tensor:
    """Mean token cross-entropy of the whole batch; `boundary(i, x, input_ids)`, when given, replaces the
    hidden state after layer i (what a codec boundary does to it)."""
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    b, s = input_ids.shape
    x = params["token_embedding.pp_block.embedding.weight"][input_ids]
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"decoder.{i}.pp_block"
        h = _rms(x, params[f"{p}.attn.norm.weight"], eps)
        q, k, v = (h @ params[f"{p}.attn.qkv_proj.weight"].T).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
        if cfg.qk_norm:
            q, k = _rms(q, params[f"{p}.attn.q_norm.weight"], eps), _rms(k, params[f"{p}.attn.k_norm.weight"], eps)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5 + mask
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, nh * hd)
        x = x + attn @ params[f"{p}.attn.o_proj.weight"].T
        h = _rms(x, params[f"{p}.mlp.norm.weight"], eps)
        gate, up = (h @ params[f"{p}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ params[f"{p}.mlp.down_proj.weight"].T
        if boundary is not None and i < cfg.num_layers - 1:
            x = boundary(i, x, input_ids)
    x = _rms(x, params["lm_head.pp_block.final_norm.weight"], eps)
    head = params["token_embedding.pp_block.embedding.weight" if cfg.tie_embeddings
                  else "lm_head.pp_block.lm_head.weight"]
    logits = x @ head.T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), label_ids.reshape(-1))
