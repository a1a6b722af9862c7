"""Standard-layout tensors -> a transformers model, in memory (generation with a KV cache) or as a folder that
`AutoModelForCausalLM.from_pretrained` loads (safetensors, config.json, generation_config.json, the tokenizer and
`nanotron_ext_export.json` saying where it came from). Needs the `hf` extra (transformers)."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.hf.names import hf_config_kwargs, to_hf_names

EXPORT_INFO = "nanotron_ext_export.json"


def require_transformers() -> None:
    import importlib.util

    from nanotron_ext.errors import UserFacingError

    if importlib.util.find_spec("transformers") is None:
        raise UserFacingError("this needs transformers: pip install -e '.[hf]' (or make setup EXTRAS=hf)")


def hf_model(cfg: ModelConfig, dense: Dict[str, torch.Tensor], eos_id: Optional[int]):
    """LlamaForCausalLM (Qwen3ForCausalLM when qk_norm) holding `dense` (our standard layout), fp32, eval mode."""
    require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if cfg.qk_norm else (LlamaConfig, LlamaForCausalLM)
    model = model_cls(config_cls(**hf_config_kwargs(cfg, eos_id)))
    state = to_hf_names(dense, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"transformers' {model_cls.__name__} expects {missing or 'no more'} and not {unexpected or '-'}")
    if cfg.tie_embeddings:
        model.tie_weights()
    return model.float().eval()


def write_folder(out: Path, model: Any, tokenizer: Any, info: Dict[str, Any]) -> Path:
    """Write model, tokenizer and `info` into a fresh temporary folder beside `out`; the caller verifies it and
    then `commit`s it (so a crash or a failed check never leaves a half-written or wrong export at `out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return tmp


def commit(tmp: Path, out: Path) -> None:
    """Move the verified folder to `out`, replacing an earlier export there."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def folder_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] of the exported folder as transformers loads it (AutoModelForCausalLM, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model(input_ids=input_ids).logits.float()
