"""What one MAPL boundary sends per optimiser step, in closed form ("Learned Subspace Compression for
Communication-Efficient Pipeline Parallelism", arXiv:2606.05484: Z and the token ids; plus what keeps the two
copies of A_p and the anchor table equal, nanotron_ext/mapl/sync.py, and the RVQ wire of
nanotron_ext/mapl/rvq.py): the per-token wire and the sync exchange that technique.MaplTechnique.closed_form_bytes
sums over a step. The ledger tests of tests/test_mapl.py and tests/test_mapl_rvq.py measure the same quantities."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Tuple

from nanotron_ext.codecs.bitpack import words_for
from nanotron_ext.mapl.rvq import index_bits
from nanotron_ext.metrics.tier_bytes import (
    element_size,
    tokens_per_micro_batch,
    tokens_per_step,
)

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config


def wire_per_token(cfg: "Config") -> Tuple[float, float, str]:
    """(forward, backward) bytes per token of the wire, and the form."""
    mapl, d, e = cfg.model.codec.mapl, cfg.model.hidden_size, element_size(cfg.model)
    r, _ = mapl.widths(d)
    if not mapl.vq_groups:
        return r * e + 4, r * e + 4, f"r x {e} B + a 4 B token id (r = {r})"
    index_words = words_for(mapl.vq_groups * mapl.vq_rounds, index_bits(mapl.vq_codebook))
    # the streamed codebook row: its number (an int32, 4 / e columns) and R r values in the wire dtype
    side = math.ceil((4 // e + mapl.vq_rounds * r) / tokens_per_micro_batch(cfg))
    forward = 4 * index_words + e * side
    grad = 4 * (words_for(r, mapl.grad_bits) + 1)  # codes + one fp32 scale per token
    return (4 + forward, 4 + max(forward, grad),
            f"RVQ: forward 4 + {4 * index_words} (indices) + {side} x {e} B (codebook stream), backward 4 + "
            f"{max(forward, grad)} ({mapl.grad_bits}-bit gradient)")


def shared_sync(cfg: "Config") -> Tuple[float, float, str]:
    """(forward, backward) bytes per step that keep the two sides' A_p and anchor table equal."""
    mapl, m = cfg.model.codec.mapl, cfg.model
    r, anchor = mapl.widths(m.hidden_size)
    if mapl.shared_sync == "dense":
        both = (m.hidden_size * r + m.vocab_size * anchor) * 4
        return both, both, "dense fp32 gradients of A_p and the anchor table each way"
    e = element_size(m)
    rows = min(m.vocab_size, tokens_per_step(cfg))  # the distinct ids of a step, at most
    return (m.hidden_size * r * e, (m.hidden_size * r + rows * anchor) * e,
            f"A_p's gradient partials each way + at most {rows} touched anchor rows back")
