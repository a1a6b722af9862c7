"""A model too large for --gpu-memory refused before the planner steps it (a ~3x10^14-parameter model was refused
only after 116 s of planning): the weights alone, spread as thin as the layout can spread them, against the GPU.

The count is the core's Llama in closed form (`dense_params`: embedding, head unless tied, per layer the norms,
attention with grouped KV heads and optional qk-norm, the SwiGLU MLP; tests/test_plan_size_check.py holds it to the
model built on the meta device) when every piece of the model is the core's. A technique's piece may replace the
dense weights with smaller ones (BOOST's low-rank linears, Subspace Models' split embedding and constrained
projections), so with one the model is built on the meta device instead (`param_count.count_params`: exact, no
memory, a few seconds). Per rank at least count / (tp x pp) parameters (some stage holds at least the average, and
replicated weights only add), each at least 2 bytes (a bf16 weight; the planner's masters are fp32: 4).
"""
from __future__ import annotations

from typing import Any, Optional

GIB = 2**30
POINTS = ("tp_strategy", "codec.kind", "embedding.kind", "output_constraint.kind")  # model keys naming a piece


def dense_params(model: Any) -> int:
    """Parameters of the core's Llama (no technique's piece) of a model config, in closed form."""
    d, f, heads, kv = model.hidden_size, model.ffn_size, model.num_heads, model.num_kv_heads
    head_dim = d // heads
    layer = (2 * d  # the two RMSNorms
             + 2 * d * heads * head_dim + 2 * d * kv * head_dim  # q and o; k and v (grouped KV heads)
             + (2 * head_dim if model.qk_norm else 0)
             + 3 * d * f)  # SwiGLU: gate, up, down
    return model.vocab_size * d * (1 if model.tie_embeddings else 2) + d + model.num_layers * layer


def _core_only(model: Any) -> bool:
    from nanotron_ext.registry import TECHNIQUES

    core = TECHNIQUES.get("core")
    if core is None:
        return False
    for point in POINTS:
        value: Any = model
        for part in point.split("."):
            value = getattr(value, part, None)
        if value is not None and value not in core.provides.get(f"model.{point}", ()):
            return False
    return True


def model_params(cfg: Any) -> int:
    """Parameters of the model DP replica 0 builds (the DP sync's replica_config): closed form where every piece
    is the core's, else built on the meta device."""
    from nanotron_ext.registry import DP_SYNCS

    replica = DP_SYNCS.owner(cfg.parallelism.dp_sync).replica_config(cfg, 0)
    if _core_only(replica.model):
        return dense_params(replica.model)
    from nanotron_ext.models.param_count import count_params

    return count_params(replica)


def too_large(cfg: Any, gpu_gib: float) -> Optional[str]:
    """One line when the weights alone of some rank exceed `gpu_gib` GiB (module docstring), else None."""
    p = cfg.parallelism
    params = model_params(cfg)
    per_rank = params / (p.tp * p.pp) * 2
    if per_rank <= gpu_gib * GIB:
        return None
    return (f"the model's {params:.3g} parameters need at least {per_rank / GIB:,.0f} GiB per rank for the weights "
            f"alone (over parallelism.tp={p.tp} x parallelism.pp={p.pp}, 2 bytes each), more than --gpu-memory "
            f"{gpu_gib:g} GiB: shrink model.hidden_size / model.ffn_size / model.num_layers / model.vocab_size or "
            "raise parallelism.tp / parallelism.pp")
