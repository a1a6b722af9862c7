"""What only the BOOST scripts share (the rest is the harness, nanotron_ext.bench).

Paper: "BOOST: Bottleneck-Optimized Scalable Training Framework for Low-Rank Large Language Models"
(Wang, Liu et al.). Three designs are compared on one model shape and batch: `megatron` (full rank,
the paper's FullRank-TP), `vanilla` (low rank, Megatron TP per factor: Vanilla-TP) and `btp`
(bottleneck-aware TP: BOOST). Here: how a config becomes each design, the Table 6 closed forms
(nanotron_ext.boost.comm_volume, with their GQA form), one decoder block's TP bytes from the comm ledger, the
saved-tensor probe that sees the inputs of low-rank checkpoint frames, and one colour per design in every figure.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # scripts run as files (and under torchrun): make `reproduce` importable
    sys.path.insert(0, str(REPO))

from nanotron_ext.bench import workload  # noqa: E402
from nanotron_ext.boost.comm_volume import kv_width, table6_tp_elements  # noqa: E402,F401 (the scripts' names)

DESIGNS = ("megatron", "vanilla", "btp")
PAPER = "BOOST: Bottleneck-Optimized Scalable Training Framework for Low-Rank Large Language Models"
# Sec. 5.2 and app. B.3: the paper trains in pure bf16 (bf16 weights and activations). Under model.dtype bf16 every
# block, part or GEMM a script times outside the trainer computes so (nanotron_ext.bench.workload.timing_precision);
# whole training iterations (iter_compare, fig6) use the trainer's own bf16, autocast over fp32 weights.
PRECISION = "pure"


# ------------------------------------------------------------------------------------------------
# configs of the three designs
# ------------------------------------------------------------------------------------------------
def strategy_overrides(strategy: str, low_rank_kind: str, rmsnorm: Optional[str] = None) -> List[str]:
    """What turns the shared model into one compared row: full-rank Megatron, or a low-rank model
    under vanilla / bottleneck-aware TP."""
    if strategy == "megatron":
        return ["model.low_rank.kind=none", "model.tp_strategy=megatron"]
    out = [f"model.low_rank.kind={low_rank_kind}", f"model.tp_strategy={strategy}"]
    if rmsnorm is not None:
        out.append(f"model.boost.rmsnorm={rmsnorm}")
    return out


def base_low_rank_kind(config_file: Optional[str], overrides: Sequence[str], requested: Optional[str]) -> str:
    """The factorisation the low-rank rows use: --low-rank-kind, else the base config's, else cola
    (the paper's main architecture)."""
    if requested:
        return requested
    cfg = workload.resolve_config(config_file, overrides)
    return cfg.model.low_rank.kind if cfg.model.low_rank.kind != "none" else "cola"


# ------------------------------------------------------------------------------------------------
# one decoder block (worker side)
# ------------------------------------------------------------------------------------------------
def block_input(cfg: Any, model: Any, ctx: Any, micro_batch: int) -> Any:
    """A hidden-state input of one decoder block as this strategy lays it out: [b, s, d] with a
    replicated residual stream, [b, s, d/tp] with BTP's sharded one; fp32 (timing_precision's cast
    gives it the timed dtype)."""
    import torch

    d = cfg.model.hidden_size
    d_local = d // ctx.tp_pg.size() if model.strategy.residual_sharded else d
    g = torch.Generator().manual_seed(cfg.general.seed + 1)
    x = torch.randn(micro_batch, cfg.tokens.sequence_length, d_local, generator=g)
    return x.to(ctx.device).requires_grad_(True)


def block_comm(cfg: Any, model: Any, ctx: Any, micro_batch: int) -> Dict[str, Any]:
    """TP bytes and calls of ONE decoder block, forward and backward measured separately (the
    first local block, fed a [b, s, d_local] input), with the ledger's per-op breakdown."""
    import torch

    from nanotron_ext.parallel.comm import get_ledger

    ledger = get_ledger()
    block = workload.first_local_block(model)
    out: Dict[str, Any] = {}
    with workload.timing_precision(cfg, [block], ctx.device, PRECISION) as cast:
        x = cast(block_input(cfg, model, ctx, micro_batch))
        ledger.reset()
        y = block(hidden_states=x)["hidden_states"]
        out["fwd"] = {"bytes": ledger.bytes(group="tp"), "calls": ledger.calls(group="tp"),
                      "ops": ledger.snapshot().get("tp", {})}
        ledger.reset()
        y.backward(torch.ones_like(y))
        out["bwd"] = {"bytes": ledger.bytes(group="tp"), "calls": ledger.calls(group="tp"),
                      "ops": ledger.snapshot().get("tp", {})}
    model.zero_grad(set_to_none=True)
    ledger.reset()
    return out


def activation_bytes(model: Any, forward: Any, device: Any) -> Tuple[Any, Dict[str, int]]:
    """The harness's activation probe, also counting the inputs of low-rank checkpoint frames: the
    low-rank layers call torch.utils.checkpoint through the name `lowrank.checkpoint`."""
    from nanotron_ext.boost import lowrank

    return workload.activation_bytes(model, forward, device, checkpoint_owners=[lowrank])


# ------------------------------------------------------------------------------------------------
# figures: one colour per compared design
# ------------------------------------------------------------------------------------------------
DESIGN_COLORS = {"megatron": "tab:blue", "full": "tab:blue", "vanilla": "tab:orange", "btp": "tab:green",
                 "boost": "tab:green", "online": "tab:green", "sync": "tab:red"}


def design_color(label: str) -> Optional[str]:
    low = label.lower()
    for key in ("sync", "online", "btp", "boost", "vanilla", "megatron", "full"):
        if key in low:
            return DESIGN_COLORS[key]
    return None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b
