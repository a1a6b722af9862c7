"""`model.init_from: hf:DIR`: a transformers Llama (or Qwen3) folder's tensors under our standard names
(`FolderTensors`), and the per-layer table of how close a model came to them (`format_report`).

nanotron_ext.models.init_from loads them into a model of any layout (`load_init_from_`, called by
nanotron_ext.models.build) and reports with `format_report`.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from nanotron_ext.config.checks import ConfigError
from nanotron_ext.hf.folder import safetensors_files
from nanotron_ext.hf.names import FUSED, from_hf_name


class FolderTensors(Mapping):
    """A transformers folder's tensors under our standard names, fp32, read one at a time on access; the megatron
    strategy's fused names (`attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`) are concatenations, and a tied
    folder's token table also serves as an untied head."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        self._where: Dict[str, Tuple[Path, str]] = {}
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    try:
                        ours = from_hf_name(hf_name)
                    except ValueError as e:
                        raise ConfigError(f"model.init_from: {file}: {e}") from None
                    if ours is not None:
                        self._where[ours] = (file, hf_name)
        head, table = "lm_head.pp_block.lm_head.weight", "token_embedding.pp_block.embedding.weight"
        if head not in self._where and table in self._where:  # a tied folder: an untied head starts as the table
            self._where[head] = self._where[table]
        self._fused: Dict[str, List[str]] = {}
        for fused, parts in FUSED.items():
            module = fused.split(".")[0]  # attn.qkv_proj.weight -> attn
            first = f"{module}.{parts[0]}_proj.weight"
            for name in [n for n in self._where if n.endswith(first)]:
                base = name[: -len(first)]
                members = [f"{base}{module}.{p}_proj.weight" for p in parts]
                if all(m in self._where for m in members):
                    self._fused[base + fused] = members

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._fused:
            return torch.cat([self[m] for m in self._fused[name]])
        from safetensors import safe_open

        file, hf_name = self._where[name]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(hf_name).float()

    def __iter__(self) -> Iterator[str]:
        return iter([*self._where, *self._fused])

    def __len__(self) -> int:
        return len(self._where) + len(self._fused)


_COLUMNS = ("q", "k", "v", "o", "attn_norm", "q_norm", "k_norm", "gate", "up", "down", "mlp_norm",
            "embedding", "final_norm", "lm_head")


def _cell(name: str) -> Tuple[str, str]:
    """(row, column) of a standard name: ('layer 3', 'q') for decoder.3.pp_block.attn.q_proj.weight."""
    parts = name.split(".")
    if parts[0] != "decoder":
        return "embedding/head", parts[-2]
    leaf = parts[-2]
    column = f"{parts[-3]}_norm" if leaf == "norm" else leaf.replace("_proj", "")
    return f"layer {parts[1]}", column


def format_report(errors: Dict[str, float], kept: List[str], folder: Path) -> str:
    """One row per layer: each imported tensor's relative error (0 = copied exactly)."""
    rows: Dict[str, Dict[str, float]] = {}
    for name, err in errors.items():
        row, column = _cell(name)
        rows.setdefault(row, {})[column] = err
    order = sorted(rows, key=lambda r: -1 if not r.startswith("layer") else int(r.split()[1]))
    rank = {c: i for i, c in enumerate(_COLUMNS)}
    lines = [f"init_from {folder}: relative error ||W - W_hf|| / ||W_hf|| of each imported weight (0 = exact)"]
    for row in order:
        cells = sorted(rows[row].items(), key=lambda kv: rank.get(kv[0], len(rank)))
        lines.append(f"  {row:<15} " + "  ".join(f"{c} {e:.3g}" for c, e in cells))
    if kept:
        lines.append(f"  kept as initialised (no counterpart in a Llama): {len(kept)} parameters, e.g. {kept[0]}")
    return "\n".join(lines)
