"""An independent single-process low-rank Llama in plain torch, float64, for BOOST parity tests.

Shares no model code with nanotron_ext: only the parameter names (the checkpoint format), the init
function, and reference_llama's RMSNorm/RoPE helpers (themselves independent of the package).
Low-rank kinds, written out from the BOOST paper (appendix B.3):

    svd   y = U (D x)            cola  y = U silu(D x)            lax  y_i = U_i (D_i x_i + D_p x_p)

with D the down factor [r, in], U the up factor [out, r]. LaX adds the latent D_p x_p of the
previous low-rank layer p on a block's data path: o <- v, gate <- o, up <- o, down <- up.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from nanotron_ext.config.schema import ModelConfig
from tests.reference_llama import _rms, _rope, params_from_shapes

_LAX_FROM = {"o": "v", "gate": "o", "up": "o", "down": "up"}


def _linear_shapes(cfg: ModelConfig) -> Dict[str, tuple]:
    d, f, hd = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d), "up": (f, d), "down": (d, f)}


def _factorised(cfg: ModelConfig, name: str) -> bool:
    return cfg.low_rank.kind != "none" and name in cfg.low_rank.targets


def reference_param_shapes(cfg: ModelConfig) -> Dict[str, tuple]:
    d, r = cfg.hidden_size, cfg.low_rank.width(cfg.hidden_size)
    shapes = {"token_embedding.pp_block.embedding.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"decoder.{i}.pp_block"
        shapes[f"{p}.attn.norm.weight"] = (d,)
        shapes[f"{p}.mlp.norm.weight"] = (d,)
        for name, (out, inp) in _linear_shapes(cfg).items():
            sub = "attn" if name in ("q", "k", "v", "o") else "mlp"
            if _factorised(cfg, name):
                shapes[f"{p}.{sub}.{name}_proj.down.weight"] = (r, inp)
                shapes[f"{p}.{sub}.{name}_proj.up.weight"] = (out, r)
            else:
                shapes[f"{p}.{sub}.{name}_proj.weight"] = (out, inp)
        if cfg.qk_norm:
            shapes[f"{p}.attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{p}.attn.k_norm.weight"] = (cfg.head_dim,)
    shapes["lm_head.pp_block.final_norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.pp_block.lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def reference_params(cfg: ModelConfig, seed: int) -> Dict[str, torch.Tensor]:
    return params_from_shapes(cfg, reference_param_shapes(cfg), seed)


def reference_loss(cfg: ModelConfig, params: Dict[str, torch.Tensor], input_ids: torch.Tensor,
                   label_ids: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of the whole batch."""
    eps, hd, nh, nkv, kind = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.low_rank.kind
    b, s = input_ids.shape
    x = params["token_embedding.pp_block.embedding.weight"][input_ids]
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"decoder.{i}.pp_block"
        z: Dict[str, torch.Tensor] = {}  # this block's latents D x, for LaX

        def lin(sub: str, name: str, inp: torch.Tensor, p: str = p, z: Dict[str, torch.Tensor] = z) -> torch.Tensor:
            key = f"{p}.{sub}.{name}_proj"
            if not _factorised(cfg, name):
                return inp @ params[f"{key}.weight"].T
            z[name] = inp @ params[f"{key}.down.weight"].T
            h = z[name]
            if kind == "cola":
                h = F.silu(h)
            elif kind == "lax" and name in _LAX_FROM and _LAX_FROM[name] in z:
                h = h + z[_LAX_FROM[name]]
            return h @ params[f"{key}.up.weight"].T

        h = _rms(x, params[f"{p}.attn.norm.weight"], eps)
        q = lin("attn", "q", h).view(b, s, nh, hd)
        k = lin("attn", "k", h).view(b, s, nkv, hd)
        v = lin("attn", "v", h).view(b, s, nkv, hd)
        if cfg.qk_norm:
            q, k = _rms(q, params[f"{p}.attn.q_norm.weight"], eps), _rms(k, params[f"{p}.attn.k_norm.weight"], eps)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5 + mask
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, nh * hd)
        x = x + lin("attn", "o", attn)
        h = _rms(x, params[f"{p}.mlp.norm.weight"], eps)
        gate, up = lin("mlp", "gate", h), lin("mlp", "up", h)
        x = x + lin("mlp", "down", F.silu(gate) * up)
    x = _rms(x, params["lm_head.pp_block.final_norm.weight"], eps)
    head = params["token_embedding.pp_block.embedding.weight" if cfg.tie_embeddings
                  else "lm_head.pp_block.lm_head.weight"]
    logits = x @ head.T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), label_ids.reshape(-1))
