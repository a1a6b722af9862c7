"""GPU kernel efficiency per GEMM shape, for the model clock (issue 54 item 4).

The clock prices every FLOP at one effective throughput; what no CPU can give is how that throughput moves with the
GEMM's shape (a low-rank factor, a batch of one, vanilla TP's thin shards run at a lower fraction of peak). `make
gpu-check STAGES=gemm` (benchmarks/gpu_check_gemm.py) times the shapes and writes a table:

    {"device": "...", "peak_tflops": P, "dtype": "bf16",
     "shapes": [{"m": M, "k": K, "n": N, "tflops": T, "efficiency": T / P}, ...]}

and `--gemm-efficiency FILE` (reproduce/paper_scale.py, bench/step_time.py) reads it: a config's decoder-layer GEMMs
on one TP rank (`layer_gemms`: closed form from its sizes, TP strategy and low-rank kind) give its mix's efficiency,
the flops-weighted harmonic mean of the shapes' (`mix_efficiency`: the time the mix takes at the measured rates).
The backward's two GEMMs per linear ([M, N] x [N, K] and [K, M] x [M, N]) are taken at the forward shape's
efficiency, and BOOST's grouping (wider fused GEMMs) is not modelled: the table times ungrouped shapes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

from nanotron_ext.errors import UserFacingError

Shape = Tuple[int, int, int]  # (m, k, n): [m, k] x [k, n]


def linears(d: int, ffn: int, heads: int, kv_heads: int) -> List[Tuple[str, int, int]]:
    """A Llama decoder layer's linears as (name, in, out)."""
    kv = kv_heads * (d // heads)
    return [("q", d, d), ("k", d, kv), ("v", d, kv), ("o", d, d), ("gate", d, ffn), ("up", d, ffn), ("down", ffn, d)]


def layer_gemms(cfg: Any) -> List[Tuple[Shape, int]]:
    """One decoder layer's forward GEMMs on one TP rank, ((m, k, n), count): Megatron's column (q, k, v, gate, up:
    out / tp) and row (o, down: in / tp) shards; a low-rank linear (model.low_rank: in -> rank -> out) as its two
    factors, vanilla TP's d -> r -> d chunk column then row (in -> r / tp, r / tp -> out), BOOST's BTP shifted by one
    (in / tp -> r, r -> out / tp)."""
    m_cfg, tp = cfg.model, cfg.parallelism.tp
    m = cfg.tokens.micro_batch_size * cfg.tokens.sequence_length
    low = getattr(m_cfg, "low_rank", None)
    kind = getattr(low, "kind", "none") or "none"
    targets = set(getattr(low, "targets", []) or [])
    strategy = getattr(m_cfg, "tp_strategy", "megatron")
    out: Dict[Shape, int] = {}

    def add(k: int, n: int) -> None:
        shape = (m, max(1, k), max(1, n))
        out[shape] = out.get(shape, 0) + 1

    for name, fan_in, fan_out in linears(m_cfg.hidden_size, m_cfg.ffn_size, m_cfg.num_heads, m_cfg.num_kv_heads):
        if kind != "none" and name in targets:
            r = low.rank
            if strategy == "btp":
                add(fan_in // tp, r), add(r, fan_out // tp)
            else:
                add(fan_in, r // tp), add(r // tp, fan_out)
        elif name in ("o", "down"):
            add(fan_in // tp, fan_out)
        else:
            add(fan_in, fan_out // tp)
    return sorted(out.items())


def newton_schulz_gemms(rows: int, cols: int) -> List[Tuple[Shape, int]]:
    """One quintic Newton-Schulz iteration on a [rows, cols] matrix, on its wide orientation (m = min, n = max):
    A = X X^T ([m, n] x [n, m]), B = b A + c A A ([m, m] x [m, m]), X' = a X + B X ([m, m] x [m, n])."""
    m, n = min(rows, cols), max(rows, cols)
    return [((m, n, m), 1), ((m, m, m), 1), ((m, m, n), 1)]


def load_table(path: Path, flag: str = "--gemm-efficiency") -> Dict[str, Any]:
    """The table `make gpu-check STAGES=gemm` wrote: {"device", "peak_tflops", "efficiency": {(m, k, n): e}}; a
    damaged file is one line naming the flag, the file and the key."""
    from nanotron_ext.cli_checks import JsonFile

    saved = JsonFile(Path(path), flag, error=UserFacingError,
                     advice="give the gemm_efficiency.json that `make gpu-check STAGES=gemm` wrote")
    data = saved.read_object()
    saved.need(data, "device", str)
    peak = saved.number(data, "peak_tflops", low=0.0, low_open=True)
    table: Dict[Shape, float] = {}
    for i, row in enumerate(saved.need(data, "shapes", list)):
        where = f"shapes[{i}]"
        if not isinstance(row, dict):
            saved.fail(f"{where} is not an object")
        shape = tuple(int(saved.number(row, key, where, low=1.0)) for key in ("m", "k", "n"))
        table[shape] = saved.number(row, "efficiency", where, low=0.0, low_open=True)  # type: ignore[index]
    if not table:
        saved.fail("shapes is empty")
    return {"device": data["device"], "peak_tflops": peak, "efficiency": table, "path": str(path)}


def mix_efficiency(table: Dict[str, Any], gemms: List[Tuple[Shape, int]]) -> float:
    """The measured efficiency of a GEMM mix: its FLOPs over the time it takes at each shape's efficiency (the
    flops-weighted harmonic mean); a shape the table lacks is one line naming it and the file."""
    flops = seconds = 0.0
    for shape, count in gemms:
        if shape not in table["efficiency"]:
            raise UserFacingError(f"--gemm-efficiency {table['path']}: no GEMM of shape m={shape[0]} k={shape[1]} "
                                  f"n={shape[2]}; time it with `make gpu-check STAGES=gemm` (it times every shape of "
                                  "the BOOST configs and Muon's Newton-Schulz)")
        f = 2.0 * math.prod(shape) * count
        flops += f
        seconds += f / table["efficiency"][shape]
    return flops / seconds
