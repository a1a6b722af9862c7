"""Our standard layout <-> transformers' Llama (Qwen3 when model.qk_norm) names and configs.

Architecture equivalence (checked numerically by tests/test_hf_export.py): RoPE in the rotate-half convention on
the natural head layout (transformers' Llama convention, so q/k rows need no permutation), RMSNorm in fp32 with
the weight applied after the cast back (as LlamaRMSNorm), SwiGLU with silu, GQA by repeated kv heads, no biases,
qk-norm as Qwen3 applies it (per head, over head_dim, before RoPE), the head tied to the embedding or not.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.errors import NoDenseEquivalent

if TYPE_CHECKING:
    from nanotron_ext.config.schema import ModelConfig

_L = "decoder.{i}.pp_block."
# (our standard name, transformers name); {i} = layer, {p} = which projection / norm
_PAIRS: List[Tuple[str, str]] = [
    ("token_embedding.pp_block.embedding.weight", "model.embed_tokens.weight"),
    (_L + "attn.norm.weight", "model.layers.{i}.input_layernorm.weight"),
    (_L + "attn.{p}_proj.weight", "model.layers.{i}.self_attn.{p}_proj.weight"),
    (_L + "attn.{p}_norm.weight", "model.layers.{i}.self_attn.{p}_norm.weight"),
    (_L + "mlp.norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (_L + "mlp.{p}_proj.weight", "model.layers.{i}.mlp.{p}_proj.weight"),
    ("lm_head.pp_block.final_norm.weight", "model.norm.weight"),
    ("lm_head.pp_block.lm_head.weight", "lm_head.weight"),
]
_GROUPS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>q|k|v|o|gate|up|down)"}
# the megatron strategy fuses these column linears (contiguous chunks of the unsharded weight)
FUSED = {"attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
# tensors some folders carry that are not weights (recomputed by transformers)
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def _regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{[ip]\})", template)
    return re.compile("".join(_GROUPS[p[1]] if p in ("{i}", "{p}") else re.escape(p) for p in parts) + "$")


_TO_HF = [(_regex(ours), hf) for ours, hf in _PAIRS]
_FROM_HF = [(_regex(hf), ours) for ours, hf in _PAIRS]


def _fill(template: str, m: re.Match) -> str:
    return template.format(**m.groupdict())


def _widths(cfg: "ModelConfig") -> Dict[str, int]:
    return {"q": cfg.num_heads * cfg.head_dim, "k": cfg.num_kv_heads * cfg.head_dim,
            "v": cfg.num_kv_heads * cfg.head_dim,
            "gate": cfg.ffn_size, "up": cfg.ffn_size}


def split_fused(state: Dict[str, torch.Tensor], cfg: "ModelConfig") -> Dict[str, torch.Tensor]:
    """Fused megatron linears (`qkv_proj`, `gate_up_proj`) as one weight per projection."""
    out, widths = {}, _widths(cfg)
    for name, value in state.items():
        fused = next((f for f in FUSED if name.endswith(f)), None)
        if fused is None:
            out[name] = value
            continue
        base = name[: -len(fused)] + fused.split(".")[0] + "."
        for p, chunk in zip(FUSED[fused], value.split([widths[p] for p in FUSED[fused]], dim=0)):
            out[f"{base}{p}_proj.weight"] = chunk
    return out


def to_hf_names(state: Dict[str, torch.Tensor], cfg: "ModelConfig") -> Dict[str, torch.Tensor]:
    """Our standard-layout tensors under transformers' names; a parameter without one (a module that states no
    dense equivalent) is refused naming it."""
    out = {}
    for name, value in split_fused(state, cfg).items():
        hit = next(((m, hf) for rx, hf in _TO_HF if (m := rx.match(name))), None)
        if hit is None:
            raise NoDenseEquivalent(f"parameter {name} has no place in a {architecture(cfg)}")
        out[_fill(hit[1], hit[0])] = value
    return out


def from_hf_name(hf_name: str) -> str | None:
    """Our standard name of a transformers tensor name (None for tensors that are not weights, e.g. inv_freq)."""
    if _IGNORED_HF.match(hf_name):
        return None
    for rx, ours in _FROM_HF:
        m = rx.match(hf_name)
        if m:
            return _fill(ours, m)
    raise ValueError(f"tensor {hf_name} has no place in our Llama")


def architecture(cfg: "ModelConfig") -> str:
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def hf_config_kwargs(cfg: "ModelConfig", eos_id: int | None) -> Dict[str, Any]:
    """Keyword arguments of transformers' LlamaConfig / Qwen3Config for the same model."""
    kwargs: Dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False,
        architectures=[architecture(cfg)],
    )
    if not cfg.qk_norm:
        kwargs["mlp_bias"] = False
    if eos_id is not None:  # our data pipeline: no BOS, documents end with EOS; generation pads with it
        kwargs.update(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return kwargs


def read_hf_config(folder: Path) -> Dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.init_from: {folder} has no config.json (a folder written by transformers' "
                          "save_pretrained is expected)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.init_from: {path} cannot be read ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.init_from: {path} holds a JSON {type(hf).__name__}, not an object (a transformers "
                          "config.json is one object of keys)")
    return hf


def _rope_theta(hf: Dict[str, Any], folder: str) -> float:
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 spell it differently
        section = hf.get(key) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"model.init_from: {folder}/config.json has {key}={section!r}; an object is expected")
        kind = section.get("rope_type", section.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"model.init_from: {key}.rope_type={kind!r} (scaled RoPE) is not our RoPE; only "
                              "'default' imports")
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def check_hf_config(hf: Dict[str, Any], cfg: "ModelConfig", folder: str) -> None:
    """Fail naming our key and the folder's value when the folder's model is not the one `cfg` builds."""
    kind = hf.get("model_type")
    if kind not in ("llama", "qwen3"):
        raise ConfigError(f"model.init_from: {folder} holds a {kind!r} model; llama (or qwen3 with model.qk_norm=true) "
                          "imports")
    if (kind == "qwen3") != cfg.qk_norm:
        raise ConfigError(f"model.qk_norm={cfg.qk_norm} but {folder} holds a {kind} model (qwen3 has qk-norm, llama "
                          f"has none); set model.qk_norm: {str(kind == 'qwen3').lower()}")
    heads = hf.get("num_attention_heads")
    expected = {
        "vocab_size": ("vocab_size", hf.get("vocab_size")), "hidden_size": ("hidden_size", hf.get("hidden_size")),
        "ffn_size": ("intermediate_size", hf.get("intermediate_size")),
        "num_layers": ("num_hidden_layers", hf.get("num_hidden_layers")), "num_heads": ("num_attention_heads", heads),
        "num_kv_heads": ("num_key_value_heads", hf.get("num_key_value_heads") or heads),
        "rms_norm_eps": ("rms_norm_eps", hf.get("rms_norm_eps")), "rope_theta": ("rope_theta", _rope_theta(hf, folder)),
    }
    # the other way round, the head starts as a copy
    if cfg.tie_embeddings and not hf.get("tie_word_embeddings", False):
        raise ConfigError(f"model.tie_embeddings=true but {folder} has a head of its own (tie_word_embeddings=false); "
                          "set model.tie_embeddings: false")
    for ours, (theirs, value) in expected.items():
        if getattr(cfg, ours) != value:
            raise ConfigError(f"model.{ours}={getattr(cfg, ours)!r} but {folder}/config.json has {theirs}={value!r}; "
                              f"set model.{ours}: {value}")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim != cfg.head_dim:
        raise ConfigError(f"model.init_from: {folder} has head_dim={head_dim}, ours is hidden_size / num_heads = "
                          f"{cfg.head_dim}; such a model does not import")
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, allowed) != allowed:
            raise ConfigError(f"model.init_from: {folder} has {key}={hf[key]!r}; only {key}={allowed!r} imports")
