"""Low-rank (bottleneck) linears of the Llama family: which linears are factorised, and how a latent
is formed between the two factors (BOOST appendix B.3).

A factorised linear W (out x in) becomes y = up(h(down(x))), down: in -> r, up: r -> out:

    svd   h(z) = z                         y = A(Bx)
    cola  h(z) = silu(z)                   y = A silu(Bx)   (CoLA applies it on every factorised linear)
    lax   h(z_i) = z_i + z_{i-1}           y_i = B_i(A_i x_i + A_{i-1} x_{i-1})   (identity gate)

LaX, our reading of eq. 8: z_{i-1} = A_{i-1} x_{i-1} is the latent (down-projection output, before
its own crossing) of the previous low-rank layer, "previous" taken along the data path through a
decoder block:

    o <- v          attention output is a mix of value rows, so v's latent is what o's input is made of
    gate, up <- o   both read x_attn = residual + o(...)
    down <- up      SwiGLU's linear branch
    q, k, v         no predecessor: the previous one (last block's down) would have to cross the decoder
                    layer interface and pipeline boundaries, which carry only the hidden state

A crossing exists only when both ends are factorised. Parameter names do not depend on the TP
strategy or on grouping: `<linear>_proj.down.weight` [r, in] and `<linear>_proj.up.weight` [out, r]
for factorised linears, `<linear>_proj.weight` [out, in] for full-rank ones.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nanotron_ext.config.schema import ModelConfig

logger = logging.getLogger(__name__)

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
LAX_PREVIOUS: Dict[str, str] = {"o": "v", "gate": "o", "up": "o", "down": "up"}


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    name: str
    in_features: int
    out_features: int
    rank: Optional[int]
    """Bottleneck width; None for a full-rank linear."""

    @property
    def factorised(self) -> bool:
        return self.rank is not None


def linear_specs(cfg: ModelConfig) -> Dict[str, LinearSpec]:
    """Shape and rank of each of the seven linears of a decoder block."""
    d, f = cfg.hidden_size, cfg.ffn_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out), "o": (q_out, d), "gate": (d, f),
              "up": (d, f), "down": (f, d)}
    low = cfg.low_rank.kind != "none"
    return {
        n: LinearSpec(n, i, o, cfg.low_rank.width(cfg.hidden_size) if low and n in cfg.low_rank.targets else None)
        for n, (i, o) in shapes.items()
    }


def lax_previous(specs: Dict[str, LinearSpec], kind: str) -> Dict[str, str]:
    """name -> the linear whose latent LaX adds into this one's, for pairs that are both factorised."""
    if kind != "lax":
        return {}
    return {n: p for n, p in LAX_PREVIOUS.items() if specs[n].factorised and specs[p].factorised}


def latent(kind: str, name: str, pure: Dict[str, torch.Tensor], previous: Dict[str, str]) -> torch.Tensor:
    """h(z) for linear `name` given the pure latents z (down outputs) seen so far in this block."""
    z = pure[name]
    if kind == "cola":
        return F.silu(z)
    if name in previous:
        return z + pure[previous[name]]
    return z


class LatentRelay:
    """Hands o's latent from a decoder layer's attention to its MLP (LaX: gate/up <- o).

    DecoderLayer runs attention then MLP back to back for one micro-batch, so one slot suffices;
    `take` empties it so a stale latent can never be reused.
    """

    def __init__(self) -> None:
        self._latent: Optional[torch.Tensor] = None

    def put(self, z: torch.Tensor) -> None:
        self._latent = z

    def take(self) -> torch.Tensor:
        z, self._latent = self._latent, None
        if z is None:
            raise RuntimeError("LaX: the MLP ran before its layer's attention published o's latent")
        return z


def maybe_checkpoint(enabled: bool, fn: Callable, *args, **kwargs):
    """Run `fn` keeping only its inputs for backward (recomputed there) when enabled.

    Callers pass collective-free functions only, so the re-forward issues no communication.
    """
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


_WARNED: set = set()


def warn_once(msg: str) -> None:
    """Log a fallback once per process (every layer would otherwise repeat it)."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)
