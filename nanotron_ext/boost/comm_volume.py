"""BOOST's TP communication volume in closed form: Table 6 of "BOOST: Bottleneck-Optimized Scalable Training
Framework for Low-Rank Large Language Models" (arXiv:2512.12131; Table 1 in the body), with its GQA form.
The reproduction scripts check it against the comm ledger (reproduce/boost/iter_compare.py, fig8_comm.py);
`config show` scales it to a training step (technique.BoostTechnique.closed_form_bytes)."""
from __future__ import annotations

from typing import Any, Optional


def table6_tp_elements(strategy: str, b: int, s: int, d: int, d_ff: int, r: int, kv_width: Optional[int] = None) -> int:
    """TP all-reduce payload of ONE decoder block in ONE forward pass, in elements (norm statistics
    and embedding omitted). The paper assumes MHA: full rank 2bsd, vanilla low rank 5bsd + 2bs*d_ff,
    BTP 7bsr. With grouped kv heads (kv_width = num_kv_heads * head_dim < d) vanilla's k and v
    up-projections all-reduce kv_width-wide outputs: 3bsd + 2bs*kv_width + 2bs*d_ff. Full rank (one
    all-reduce after o and after down) and BTP (every chunk on the r-wide bottleneck) do not change."""
    kv = d if kv_width is None else kv_width
    if strategy == "megatron":
        return 2 * b * s * d
    if strategy == "vanilla":
        return 3 * b * s * d + 2 * b * s * kv + 2 * b * s * d_ff
    if strategy == "btp":
        return 7 * b * s * r
    raise ValueError(f"no Table 6 closed form for strategy {strategy!r}")


def kv_width(model_cfg: Any) -> int:
    """num_kv_heads * head_dim of a model config."""
    return model_cfg.num_kv_heads * (model_cfg.hidden_size // model_cfg.num_heads)
