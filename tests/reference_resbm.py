"""An independent single-process float64 ResBM (arXiv:2604.11947, sec. 3.2-3.3) for parity tests.

Written from the paper's equations, sharing no code with nanotron_ext.resbm: trunc/pad are matrix
products with the rectangular identity of eq. 4-5, E and D are explicit matmuls. The Llama parts
are tests/reference_llama.py's helpers; parameter names and the init function are shared with the
model only so both start from the same weights.

    b_l          = x_attn_l I_{d x h} + E_l(FF(norm(x_attn_l)))       E = W2 act(W1 .)
    x_attn_{l+1} = b_l I_{h x d} + Attn(norm(D_{l+1}(b_l)))         D = W2 act(W1 .)
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch
import torch.nn.functional as F

from nanotron_ext.config.schema import ModelConfig
from tests.reference_llama import _rms, _rope, params_from_shapes, reference_param_shapes

ACT = {"silu": lambda x: x * torch.sigmoid(x), "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2**0.5)),
       "relu": lambda x: x.clamp_min(0), "tanh": torch.tanh, "identity": lambda x: x}


def rect_identity(c: int, C: int) -> torch.Tensor:
    """[I_{c x C}]_{ij} = 1 if i == j else 0 (eq. 4)."""
    return torch.eye(c, C, dtype=torch.float64)


def resbm_param_shapes(cfg: ModelConfig, boundaries: Iterable[int], h: int, m: int) -> Dict[str, tuple]:
    d, shapes = cfg.hidden_size, reference_param_shapes(cfg)
    for i in boundaries:
        enc, dec = f"decoder.{i}.pp_block.boundary_encoder.net", f"decoder.{i + 1}.pp_block.boundary_decoder.net"
        shapes.update({f"{enc}.fc1.weight": (m, d), f"{enc}.fc2.weight": (h, m),
                       f"{dec}.fc1.weight": (m, h), f"{dec}.fc2.weight": (d, m)})
        norm = cfg.codec.resbm.norm
        if norm in ("encoder", "both"):
            shapes[f"{enc}.norm.weight"] = (d,)
        if norm in ("decoder", "both"):
            shapes[f"{dec}.norm.weight"] = (h,)
    return shapes


def resbm_params(cfg: ModelConfig, boundaries: Iterable[int], h: int, m: int, seed: int) -> Dict[str, torch.Tensor]:
    params = params_from_shapes(cfg, resbm_param_shapes(cfg, boundaries, h, m), seed)
    rc = cfg.codec.resbm
    with torch.no_grad():
        for name, p in params.items():
            if (rc.zero_init_encoder and "boundary_encoder.net.fc2" in name) or \
                    (rc.zero_init_decoder and "boundary_decoder.net.fc2" in name):
                p.zero_()
    return params


def _attn(cfg: ModelConfig, P: Dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    b, s, _ = x.shape
    h = _rms(x, P[f"{p}.attn.norm.weight"], eps)
    q, k, v = (h @ P[f"{p}.attn.qkv_proj.weight"].T).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.view(b, s, nh, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
    if cfg.qk_norm:
        q, k = _rms(q, P[f"{p}.attn.q_norm.weight"], eps), _rms(k, P[f"{p}.attn.k_norm.weight"], eps)
    q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    k, v = k.repeat_interleave(nh // nkv, dim=2), v.repeat_interleave(nh // nkv, dim=2)
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5 + mask
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, nh * hd)
    return out @ P[f"{p}.attn.o_proj.weight"].T


def _ff(cfg: ModelConfig, P: Dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = (_rms(x, P[f"{p}.mlp.norm.weight"], cfg.rms_norm_eps) @ P[f"{p}.mlp.gate_up_proj.weight"].T).chunk(2, -1)
    return (F.silu(gate) * up) @ P[f"{p}.mlp.down_proj.weight"].T


def _two_layer(cfg: ModelConfig, P: Dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    if f"{p}.norm.weight" in P:
        x = _rms(x, P[f"{p}.norm.weight"], cfg.rms_norm_eps)
    return ACT[cfg.codec.resbm.nonlinearity](x @ P[f"{p}.fc1.weight"].T) @ P[f"{p}.fc2.weight"].T


def resbm_loss(cfg: ModelConfig, P: Dict[str, torch.Tensor], boundaries: List[int], h: int,
               input_ids: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
    d = cfg.hidden_size
    x = P["token_embedding.pp_block.embedding.weight"][input_ids]
    hidden = x  # what the attention normalises (D(b) after a boundary)
    for i in range(cfg.num_layers):
        p = f"decoder.{i}.pp_block"
        x_attn = x + _attn(cfg, P, p, hidden)
        branch = _ff(cfg, P, p, x_attn)
        if i in boundaries:
            b = x_attn @ rect_identity(d, h) + _two_layer(cfg, P, f"{p}.boundary_encoder.net", branch)
            x = b @ rect_identity(h, d)
            hidden = _two_layer(cfg, P, f"decoder.{i + 1}.pp_block.boundary_decoder.net", b)
        else:
            x = hidden = x_attn + branch
    x = _rms(x, P["lm_head.pp_block.final_norm.weight"], cfg.rms_norm_eps)
    logits = x @ P["lm_head.pp_block.lm_head.weight"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), label_ids.reshape(-1))
