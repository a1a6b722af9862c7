"""Standard-layout tensors -> a transformers model, in memory (generation with a KV cache) or as a folder that
`AutoModelForCausalLM.from_pretrained` loads (safetensors, config.json, generation_config.json, the tokenizer and
`nanotron_ext_export.json` saying where it came from). Needs the `hf` extra (transformers)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from nanotron_ext.cli_checks import output_folder
from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.errors import UserFacingError
from nanotron_ext.fileio import replace_folder
from nanotron_ext.hf.names import hf_config_kwargs, to_hf_names

EXPORT_INFO = "nanotron_ext_export.json"
"""Written into every export, listing the files it wrote: --overwrite replaces only a folder that has it."""
RUN_RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "loss.png", ".lock")


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
        raise ValueError(f"transformers' {model_cls.__name__} expects {missing or 'no more'} and not "
                         f"{unexpected or '-'}")
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
    info["files"] = sorted([p.name for p in tmp.iterdir()] + [EXPORT_INFO])
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return tmp


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, naming `out`, a folder export may not write: a file, a non-empty folder without --overwrite, and
    with it any folder holding what no export wrote (a run folder, a checkpoint folder): nothing is deleted."""
    output_folder("--out", out)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserFacingError(f"--out {out} exists and is not empty; choose another folder or pass --overwrite (it "
                              "replaces only an earlier export)")
    foreign = _not_an_export(out)
    if foreign:
        raise UserFacingError(f"--out {out} is not an earlier export ({foreign}): --overwrite replaces only a folder "
                              "that export wrote; nothing was deleted, choose another folder")


def _not_an_export(out: Path) -> Optional[str]:
    """Why `out` is not a folder written by export (None when it is one)."""
    try:
        info = json.loads((out / EXPORT_INFO).read_text())
    except FileNotFoundError:
        return f"it has no {EXPORT_INFO}"
    except (OSError, ValueError) as e:
        return f"its {EXPORT_INFO} cannot be read: {e}"
    if not isinstance(info, dict):
        return f"its {EXPORT_INFO} is not an export's"
    names = sorted(p.name for p in out.iterdir())
    written = info.get("files")
    if isinstance(written, list):
        extra = [n for n in names if n not in written]
    else:  # exports from before the file list: plain files, none of a run's
        extra = [n for n in names if (out / n).is_dir() or n in RUN_RECORDS]
    return f"export did not write {', '.join(extra[:3])}" if extra else None


def commit(tmp: Path, out: Path, overwrite: bool) -> None:
    """Put the verified folder at `out` in one atomic swap, replacing an earlier export there (checked again:
    the folder may have changed while the model was being written)."""
    check_out(out, overwrite)
    replace_folder(tmp, out)


@torch.no_grad()
def folder_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] of the exported folder as transformers loads it (AutoModelForCausalLM, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model(input_ids=input_ids).logits.float()
