"""Bytes per optimiser step on each bandwidth tier, by closed form, for `python -m nanotron_ext.config show` (which
prints them: nanotron_ext/config/__main__.py), the planner and the WAN meter.

Each extension point's owner (nanotron_ext.registry) answers for the piece it provides
(`Technique.closed_form_bytes`; nanotron_ext.config.tiers asks each tier's owner): the TP strategy for the TP tier, the
codec for the PP tier, the DP sync for the DP tier. The core answers for its own pieces here (megatron, identity and
the lossy baselines, allreduce). Bytes follow the comm ledger's convention (nanotron_ext.parallel.comm: the payload one
rank hands to a call, not ring traffic), so a closed form here can be checked against a run's ledger
(tests/test_three_tiers.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config, ModelConfig


@dataclasses.dataclass(frozen=True)
class TierBytes:
    """Closed-form bytes per optimiser step on one tier.

    TP tier: one TP rank's all-reduce payload, summed over the pipeline stages of a replica.
    PP tier: one codec boundary, both directions (`forward` + `backward`), summed over the TP ranks.
    DP tier: one replica's payload (summed over its TP and PP ranks), averaged per inner step."""

    forward: float
    backward: float = 0.0
    formula: str = ""
    """The form in words: what was counted, and what was left out."""
    tp_sharded: bool = False
    """PP tier: the TP ranks send disjoint shards of the wire (the form is their sum), so it crosses the stage
    link once whatever parallelism.pp_scatter_gather says (a wire that follows btp's sharded residual stream)."""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def element_size(model: "ModelConfig") -> int:
    """Bytes per value that crosses a link: the run's compute dtype (codecs/base.wire_dtype)."""
    return 2 if model.dtype == "bf16" else 4


def micro_batches(cfg: "Config") -> int:
    return cfg.tokens.batch_accumulation_per_replica


def tokens_per_micro_batch(cfg: "Config") -> int:
    return cfg.tokens.micro_batch_size * cfg.tokens.sequence_length


def tokens_per_step(cfg: "Config") -> int:
    """Tokens one replica processes per optimiser step."""
    return micro_batches(cfg) * tokens_per_micro_batch(cfg)


def wire_bytes(cfg: "Config", forward_per_token: float, backward_per_token: float, formula: str) -> TierBytes:
    """A boundary wire of a fixed width per token: bytes per step = tokens per step x bytes per token."""
    n = tokens_per_step(cfg)
    return TierBytes(n * forward_per_token, n * backward_per_token,
                     f"{formula} per token each way x {n} tokens per step")


# -- the core's pieces -----------------------------------------------------------------------------------------
def megatron_tp(cfg: "Config") -> TierBytes:
    """Megatron TP, per micro-batch of b x s tokens, width d: per layer one all-reduce after o and after down
    (forward) and one of the fused qkv and gate_up input gradients (backward), each b s d; the embedding's
    output (b s d, first stage), the head's input gradient (b s d) and the sharded cross-entropy's three
    b s statistics (last stage)."""
    m, e, n = cfg.model, element_size(cfg.model), micro_batches(cfg)
    bsd = tokens_per_micro_batch(cfg) * m.hidden_size
    forward = n * e * (2 * m.num_layers * bsd + bsd + 3 * tokens_per_micro_batch(cfg))
    backward = n * e * (2 * m.num_layers * bsd + bsd)
    extra = ""
    if m.qk_norm:
        backward += n * e * 2 * m.num_layers * (m.hidden_size // m.num_heads)
        extra = " + the qk-norm weights' gradients"
    return TierBytes(forward, backward, f"(4 L + 2) b s d + 3 b s{extra}, x {n} micro-batches")


def identity_wire(cfg: "Config") -> TierBytes:
    e = element_size(cfg.model)
    return wire_bytes(cfg, cfg.model.hidden_size * e, cfg.model.hidden_size * e, f"d x {e} B")


def lossy_wire(cfg: "Config", kind: str) -> Optional[TierBytes]:
    """The lossy baselines' bytes per token (nanotron_ext.codecs.lossy's module docstring)."""
    d, e, ratio = cfg.model.hidden_size, element_size(cfg.model), cfg.model.codec.ratio
    if kind == "topk":
        k = max(1, round(d / (2 * ratio)))
        per_token, form = k * (e + 4), f"k (e + 4), k = {k}"
    elif kind in ("int8", "int4"):
        per_token, form = (d if kind == "int8" else d / 2) + 4, "codes + one fp32 scale"
    elif kind == "lowrank":
        q, tokens = max(1, round(d / ratio)), tokens_per_micro_batch(cfg)
        per_token, form = e * (q + math.ceil(d * q / tokens)), f"e (q + ceil(d q / (b s))), q = {q}"
    else:
        return None
    return wire_bytes(cfg, per_token, per_token, form)


def dense_dp(cfg: "Config", num_params: int) -> TierBytes:
    extra = "; each TP rank also all-reduces its copy of TP-replicated parameters" if cfg.parallelism.tp > 1 else ""
    return TierBytes(4.0 * num_params, 0.0,
                     f"fp32 gradients of {num_params:,} parameters, all-reduced every step{extra}")
