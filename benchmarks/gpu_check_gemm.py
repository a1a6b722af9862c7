"""`make gpu-check STAGES=gemm` (benchmarks/gpu_check.py's gemm stage, issue 54 item 4): the GEMM shapes of BOOST's
Table 3 / Fig. 6 rows and of Muon's Newton-Schulz, timed in bf16, written as the per-shape efficiency table the
model clock reads (`--gemm-efficiency FILE` of reproduce/paper_scale.py and bench/step_time.py;
nanotron_ext/bench/clock/kernels.py has the format and the reader).

Shapes: every decoder-layer GEMM on one TP rank (bench/clock kernels.layer_gemms) of reproduce/boost's LLaMA 1B-30B
configs, full rank, vanilla low rank and BTP, at micro-batch 1, 2 and 4 (seq 4096); the three GEMMs of a quintic
Newton-Schulz iteration on each of ResBM's 2B block matrices (d = 4096, k / v 2048 wide, SwiGLU 11,008). Each is
timed as the median of `iters` calls after a warm-up (CUDA events), its FLOP/s divided by the device's dense bf16
peak (its datasheet: PEAK_TFLOPS). The dry run (CPU, CI) times the same list with every dimension divided by 64
(at least 8), fp32, against the best rate it measured (no datasheet peak for a CPU): it proves the stage and the
table's format, not a number.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STAGE = "gemm"
BUDGET_S, DRY_BUDGET_S = 25, 60
# dense bf16 tensor peak, TFLOP/s, from each vendor datasheet (NVIDIA A100, H100 PCIe and SXM, H200, A10); the
# first name the device name contains wins
PEAK_TFLOPS = {"A100": 312.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A10": 125.0}
BOOST_CONFIGS = [f"reproduce/boost/llama_{s}_{k}.yaml" for s in ("1b", "3b", "7b", "13b", "30b")
                 for k in ("fullrank", "vanilla", "btp")]
RESBM_MATRICES = [(4096, 4096), (2048, 4096), (11008, 4096)]  # q / o, k / v, gate / up / down
BATCHES = (1, 2, 4)
DRY_SCALE = 64
Shape = Tuple[int, int, int]


def shapes(dry: bool) -> List[Shape]:
    """Every shape the table needs (module docstring), once; dry: each dimension / DRY_SCALE (at least 8)."""
    from nanotron_ext.bench.clock import layer_gemms, newton_schulz_gemms
    from nanotron_ext.config.loader import load_config

    found: Dict[Shape, None] = {}
    for config in BOOST_CONFIGS:
        for b in BATCHES:
            cfg = load_config(REPO / config, [f"tokens.micro_batch_size={b}"])
            found.update({shape: None for shape, _ in layer_gemms(cfg)})
    for rows, cols in RESBM_MATRICES:
        found.update({shape: None for shape, _ in newton_schulz_gemms(rows, cols)})
    if dry:
        return sorted({tuple(max(8, x // DRY_SCALE) for x in s) for s in found})  # type: ignore[misc]
    return sorted(found)


def peak_of(device_name: str) -> float:
    """The datasheet peak of the device `device_name` (torch.cuda.get_device_name), 0 when not listed."""
    return next((p for name, p in PEAK_TFLOPS.items() if name in device_name), 0.0)


def time_shape(shape: Shape, device: str, dtype: Any, iters: int) -> float:
    """Median seconds of one [m, k] x [k, n] product."""
    import torch

    m, k, n = shape
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(dry: bool, deadline: float, iters: int = 10) -> Dict[str, Any]:
    """The table (kernels.py's format) of every shape timed before `deadline`; rows say which were skipped."""
    import torch

    cuda = torch.cuda.is_available() and not dry
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    rows: List[Dict[str, Any]] = []
    for shape in shapes(dry):
        if time.time() > deadline:
            rows.append({"m": shape[0], "k": shape[1], "n": shape[2], "status": "skipped"})
            continue
        seconds = time_shape(shape, device, dtype, 2 if dry else iters)
        rows.append({"m": shape[0], "k": shape[1], "n": shape[2], "seconds": seconds, "status": "ok",
                     "tflops": 2.0 * shape[0] * shape[1] * shape[2] / seconds / 1e12})
    timed = [r for r in rows if r["status"] == "ok"]
    peak = peak_of(name) if cuda else 0.0
    peak = peak or max((r["tflops"] for r in timed), default=1.0)  # not listed: the best measured rate
    for r in timed:
        r["efficiency"] = r["tflops"] / peak
    return {"device": name, "peak_tflops": peak, "dtype": "bf16" if cuda else "fp32",
            "peak_source": "datasheet" if cuda and peak_of(name) else "best measured rate", "rows": rows,
            "shapes": timed}


def stage_gemm(run: Any, deadline: float) -> Dict[str, Any]:
    """The gemm stage: the table, also written as <work>/gemm_efficiency.json (and copied with --copy-to) for
    `--gemm-efficiency`."""
    table = measure(run.dry, deadline)
    path = Path(run.work) / "gemm_efficiency.json"
    path.write_text(json.dumps({k: v for k, v in table.items() if k != "rows"}, indent=1) + "\n")
    if getattr(run.args, "copy_to", None):
        Path(run.args.copy_to).mkdir(parents=True, exist_ok=True)
        (Path(run.args.copy_to) / path.name).write_text(path.read_text())
    run.log(f"gemm: {len(table['shapes'])} of {len(table['rows'])} shapes timed on {table['device']}; wrote {path}")
    return {"rows": table["rows"], "device": table["device"], "peak_tflops": table["peak_tflops"],
            "peak_source": table["peak_source"], "table": str(path)}


def register(stages: Tuple[str, ...], funcs: Dict[str, Any], budgets: Dict[str, float],
             dry_budgets: Dict[str, float]) -> Tuple[str, ...]:
    """Add this stage to gpu_check's: last in the order, with its budgets; the stages with it."""
    funcs[STAGE] = stage_gemm
    budgets.setdefault(STAGE, BUDGET_S)
    dry_budgets.setdefault(STAGE, DRY_BUDGET_S)
    return stages if STAGE in stages else (*stages, STAGE)
