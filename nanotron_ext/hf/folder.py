"""`model.init_from: hf:DIR` when the job starts: the folder's safetensors files hold every tensor our model reads,
whole and of the shape the model section gives.

The importer reads the tensors only after the process groups are up, on every rank: a file cut short by an
interrupted copy (SafetensorError) or a tensor of another shape ("Sizes of tensors must match") was a traceback per
rank. Here only the headers are read (a few KB per file), once, before any work; every problem is one ConfigError
naming the file and the tensor.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Tuple

from nanotron_ext.config.checks import ConfigError

# names.py maps the tensors and reads config.json; it imports nothing of this file, so no loop
from nanotron_ext.hf.names import check_hf_config, from_hf_name, read_hf_config

if TYPE_CHECKING:
    from nanotron_ext.config.schema import ModelConfig

_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # what the importer turns into fp32 weights
_MAX_HEADER = 100 * 2**20  # safetensors' own bound on the JSON header


def safetensors_files(folder: Path) -> List[Path]:
    """The safetensors files of a transformers folder (one file, or the shards its index lists)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"model.init_from: {index} is not a transformers index (a JSON object whose "
                              f"weight_map maps tensor names to files): {type(e).__name__}: {e}") from None
        paths = [folder / str(name) for name in files]
        missing = [p for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(f"model.init_from: {index} lists {missing[0].name}, which {folder} does not have")
        return paths
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"model.init_from: {folder} has no model.safetensors (or index); re-save the model with "
                      "save_pretrained(..., safe_serialization=True)")


def read_header(file: Path) -> Dict[str, Tuple[str, List[int]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, after checking that every tensor's bytes are in it."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise ConfigError(f"model.init_from: {file} is not a safetensors file, or is cut off in its header "
                              f"({size:,} bytes); copy or download it again")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ConfigError(f"model.init_from: {file} has no valid safetensors header; copy or download it again")
    data, out = size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ConfigError(f"model.init_from: {file}: tensor {name} has a malformed header entry "
                              f"{entry!r}") from None
        if end > data:
            raise ConfigError(f"model.init_from: {file} is cut off: tensor {name} ends at byte {8 + length + end:,}, "
                              f"the file has {size:,} (an interrupted copy or download?)")
        if dtype not in _FLOAT_BYTES:
            raise ConfigError(f"model.init_from: {file}: tensor {name} is {dtype}; only float weights ("
                              f"{', '.join(_FLOAT_BYTES)}) import, not a quantised checkpoint")
        if end - begin != math.prod(shape) * _FLOAT_BYTES[dtype]:
            raise ConfigError(f"model.init_from: {file}: tensor {name} holds {end - begin:,} bytes, not the "
                              f"{math.prod(shape) * _FLOAT_BYTES[dtype]:,} of its shape {shape} in {dtype}")
        out[name] = (dtype, shape)
    return out


def expected_shapes(cfg: "ModelConfig") -> Dict[str, List[int]]:
    """{transformers tensor name: shape} of every weight a Llama (Qwen3 with qk_norm) of `cfg` has; lm_head is
    left out: a folder without one (tied) serves its embedding as the head."""
    h, f, v, d = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    layer = {"input_layernorm": [h], "self_attn.q_proj": [q, h], "self_attn.k_proj": [kv, h],
             "self_attn.v_proj": [kv, h], "self_attn.o_proj": [h, q], "post_attention_layernorm": [h],
             "mlp.gate_proj": [f, h], "mlp.up_proj": [f, h], "mlp.down_proj": [h, f]}
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm": [d], "self_attn.k_norm": [d]})
    for i in range(cfg.num_layers):
        out.update({f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    return out


def check_folder_tensors(folder: Path, cfg: "ModelConfig") -> None:
    """Every file whole, every weight of `cfg`'s model present with its shape, no tensor without a place."""
    want = expected_shapes(cfg)
    optional = {"lm_head.weight": [cfg.vocab_size, cfg.hidden_size]}
    found = set()
    for file in safetensors_files(folder):
        for name, (_, shape) in read_header(file).items():
            try:
                ours = from_hf_name(name)
            except ValueError as e:
                raise ConfigError(f"model.init_from: {file}: {e}") from None
            if ours is None:  # not a weight (rotary inv_freq)
                continue
            expected = want.get(name, optional.get(name))
            if expected is None:
                raise ConfigError(f"model.init_from: {file} has tensor {name}, which a model of this model section "
                                  f"(num_layers={cfg.num_layers}, qk_norm={cfg.qk_norm}) does not have")
            if shape != expected:
                raise ConfigError(f"model.init_from: {file}: tensor {name} has shape {shape}; the model section "
                                  f"gives {expected}")
            found.add(name)
    missing = [name for name in want if name not in found]
    if missing:
        raise ConfigError(f"model.init_from: {folder} has no tensor {missing[0]}"
                          + (f" (nor {len(missing) - 1} others)" if len(missing) > 1 else ""))


def check_init_from(cfg: "ModelConfig") -> None:
    """model.init_from when the job starts (nanotron_ext.train.__main__.check_job_start) and before a model imports it
    (nanotron_ext.models.init_from): 'hf:DIR' with a folder whose config.json matches the model section and
    whose safetensors hold every weight whole, with its shape (check_folder_tensors)."""
    value = cfg.init_from
    if not value.startswith("hf:") or not value[3:].strip():
        raise ConfigError(f"model.init_from={value!r}: expected 'hf:DIR', a folder written by transformers' "
                          "save_pretrained")
    folder = Path(value[3:]).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.init_from: {folder} is not a folder")
    check_hf_config(read_hf_config(folder), cfg, str(folder))
    check_folder_tensors(folder, cfg)
