"""Parameter counts of paper-scale configs, built on the meta device (exact shapes, no memory).

Every paper-scale YAML under reproduce/ states its size in one header line,

    # parameters: 512,404,992 (uncompressed model); paper: 512M

which `header_size` reads back and tests compare with `count_params` (so a config whose size drifts
from the paper's, e.g. a "500m" that builds 695M, fails a test). "uncompressed model" counts the
config with its codec, split embedding and output constraint switched off (the papers size the base
LLaMA); "as configured" counts everything the file builds (ResBM's sizes include the bottlenecks).
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, List, Optional, Tuple

from nanotron_ext.registry import techniques

HEADER = re.compile(r"^# parameters: ([\d,]+) \((uncompressed model|as configured)\); paper: ([\d,.]*\d)([MB]?)",
                    re.MULTILINE)
# the core's half of the uncompressed twin: every extension point at the core's own plain piece
CORE_UNCOMPRESSED = ("model.codec.kind=identity", "model.embedding.kind=standard", "model.output_constraint.kind=none")


def uncompressed_overrides() -> List[str]:
    """The overrides that turn a technique's config into the base model the papers size: the core's, then every
    registered technique's `Technique.uncompressed` (SparseLoCo: every replica the full model)."""
    return [*CORE_UNCOMPRESSED, *(o for t in techniques() for o in t.uncompressed)]


def param_shapes(cfg: Any) -> List[Tuple[int, ...]]:
    """Shapes of the distinct parameters of the whole model of `cfg` (one process, tp = pp = 1), built
    on the meta device. With codec boundaries at `stages` and pp > 1 the boundaries sit where pp stages
    would end, so these are the pipelined model's parameters."""
    import torch

    from nanotron_ext.models.llama import LlamaForTraining
    from nanotron_ext.parallel.context import standalone_context
    from nanotron_ext.parallel.p2p import AccountedP2P

    ctx = standalone_context()  # LlamaForTraining needs (1-rank) process groups even on the meta device
    model_cfg = cfg.model
    if model_cfg.codec.boundaries == "stages" and cfg.parallelism.pp > 1:
        stage_ends = [(i + 1) * model_cfg.num_layers // cfg.parallelism.pp - 1 for i in range(cfg.parallelism.pp - 1)]
        model_cfg = dataclasses.replace(model_cfg, codec=dataclasses.replace(model_cfg.codec, boundaries=stage_ends))
    with torch.device("meta"):
        model = LlamaForTraining(model_cfg, ctx, AccountedP2P(ctx.pp_pg, device=torch.device("meta")))
    return [tuple(p.shape) for p in {id(p): p for p in model.parameters()}.values()]


def count_params(cfg: Any) -> int:
    """Distinct parameters of the whole model of `cfg` (see `param_shapes`)."""
    return sum(math.prod(s) for s in param_shapes(cfg))


def count_config_file(path: str | Path, uncompressed: bool = False) -> int:
    """count_params of a YAML file (with `uncompressed`, of its base model: `uncompressed_overrides`)."""
    from nanotron_ext.config.loader import load_config

    return count_params(load_config(path, uncompressed_overrides() if uncompressed else []))


def header_line(ours: int, uncompressed: bool, paper: str) -> str:
    """The size line of a config header; `paper` as the paper writes it ("512M", "1,896,751,104")."""
    return f"# parameters: {ours:,} ({'uncompressed model' if uncompressed else 'as configured'}); paper: {paper}"


def header_size(text: str) -> Optional[Tuple[int, bool, float]]:
    """(our count, counted uncompressed, the paper's count) from a config's size line, or None."""
    m = HEADER.search(text)
    if m is None:
        return None
    scale = {"": 1, "M": 1e6, "B": 1e9}[m.group(4)]
    return int(m.group(1).replace(",",
                                  "")), m.group(2) == "uncompressed model", float(m.group(3).replace(",", "")) * scale


def fmt_count(n: float) -> str:
    """1,896,751,104 -> '1.90B'; 512,404,992 -> '512.4M'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
