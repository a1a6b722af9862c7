"""GPU kernel efficiency per GEMM shape (issue 54 item 4): the decoder layer's GEMMs in closed form per TP strategy,
the mix's efficiency (the time at the measured rates, written out here), the table's reader, the gemm stage of `make
gpu-check` dry-run on CPU, and --gemm-efficiency in reproduce/paper_scale.py (relative to the fit's run)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanotron_ext.bench.clock import layer_gemms, load_table, mix_efficiency, newton_schulz_gemms
from nanotron_ext.errors import UserFacingError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))


def _cfg(kind: str, strategy: str, tp: int = 2, b: int = 1, s: int = 8) -> SimpleNamespace:
    low = SimpleNamespace(kind=kind, rank=4, targets=["q", "k", "v", "o", "gate", "up", "down"])
    model = SimpleNamespace(hidden_size=16, ffn_size=32, num_heads=4, num_kv_heads=2, low_rank=low,
                            tp_strategy=strategy)
    return SimpleNamespace(model=model, parallelism=SimpleNamespace(tp=tp),
                           tokens=SimpleNamespace(micro_batch_size=b, sequence_length=s))


def test_a_layers_gemms_per_tp_strategy() -> None:
    """d 16, ffn 32, 4 heads (dim 4), 2 KV heads (k / v 8 wide), rank 4, TP 2, 8 tokens. Megatron: q, k, v, gate, up
    column (out / 2), o, down row (in / 2). Vanilla: each linear in -> r / 2 -> out. BTP: in / 2 -> r -> out / 2."""
    full = dict(layer_gemms(_cfg("none", "megatron")))
    # each linear: q (8,16,8) k (8,16,4) v (8,16,4) o (8,8,16) gate (8,16,16) up (8,16,16) down (8,16,16)
    assert full == {(8, 16, 8): 1, (8, 16, 4): 2, (8, 8, 16): 1, (8, 16, 16): 3}
    vanilla = dict(layer_gemms(_cfg("svd", "vanilla")))
    assert vanilla == {(8, 16, 2): 6, (8, 32, 2): 1, (8, 2, 16): 3, (8, 2, 8): 2, (8, 2, 32): 2}
    btp = dict(layer_gemms(_cfg("cola", "btp")))
    assert btp == {(8, 8, 4): 6, (8, 16, 4): 1, (8, 4, 8): 3, (8, 4, 4): 2, (8, 4, 16): 2}
    assert newton_schulz_gemms(8, 32) == [((8, 32, 8), 1), ((8, 8, 8), 1), ((8, 8, 32), 1)]


def _table(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "gemm_efficiency.json"
    path.write_text(json.dumps({"device": "test", "peak_tflops": 100.0, "dtype": "bf16", "shapes": rows}))
    return path


def test_a_mix_runs_at_its_flops_over_the_time_at_each_shapes_rate(tmp_path: Path) -> None:
    """Two shapes of 2 x 8 x 8 x 8 = 1024 and 2 x 8 x 8 x 16 x 3 = 6144 FLOPs at 50% and 80%: the mix runs at
    7168 / (1024 / 0.5 + 6144 / 0.8) = 0.7385 of peak (not the mean, 0.65)."""
    table = load_table(_table(tmp_path, [{"m": 8, "k": 8, "n": 8, "efficiency": 0.5},
                                         {"m": 8, "k": 8, "n": 16, "efficiency": 0.8}]))
    assert mix_efficiency(table, [((8, 8, 8), 1), ((8, 8, 16), 3)]) == pytest.approx(7168 / (2048 + 7680))
    with pytest.raises(UserFacingError, match="no GEMM of shape m=8 k=4 n=4"):
        mix_efficiency(table, [((8, 4, 4), 1)])


@pytest.mark.parametrize("rows,key", [([{"m": 8, "k": 8, "n": 8}], "shapes[0].efficiency is missing"),
                                      ([{"m": 8, "k": 8, "n": 8, "efficiency": 0}], "shapes[0].efficiency is 0"),
                                      ([], "shapes is empty")])
def test_a_damaged_table_is_one_line_naming_the_file_and_key(tmp_path: Path, rows: list, key: str) -> None:
    with pytest.raises(UserFacingError) as e:
        load_table(_table(tmp_path, rows))
    assert key in str(e.value) and "gemm_efficiency.json" in str(e.value) and "\n" not in str(e.value)


def test_the_gemm_stage_dry_run_writes_a_table_the_clock_reads(tmp_path: Path) -> None:
    """The CPU dry run of `make gpu-check STAGES=gemm`: every shape (BOOST's configs at batch 1-4 and ResBM's
    Newton-Schulz, divided by 64) timed, the table written, and read back by the clock's reader."""
    import gpu_check_gemm

    logs: list = []
    run = SimpleNamespace(dry=True, work=tmp_path, args=SimpleNamespace(copy_to=None), log=logs.append)
    body = gpu_check_gemm.stage_gemm(run, time.time() + 60)
    assert all(r["status"] == "ok" for r in body["rows"]) and len(body["rows"]) == len(gpu_check_gemm.shapes(True))
    table = load_table(Path(body["table"]))
    assert table["peak_tflops"] > 0 and len(table["efficiency"]) == len(body["rows"])
    assert max(table["efficiency"].values()) == pytest.approx(1.0)  # a CPU has no datasheet peak: the best rate
    assert len(gpu_check_gemm.shapes(False)) >= len(body["rows"])  # the full list (a few merge when divided)


def test_paper_scale_scales_a_run_by_its_mix_over_the_fit_runs(tmp_path: Path) -> None:
    """reproduce/paper_scale.py --gemm-efficiency: a uniform table changes nothing (the fit keeps the one fitted
    throughput); a table where the full-rank shapes run at twice the rate of every other prices 7B full rank at twice
    the fit run's (the CoLA 7B BTP block) throughput and 7B BTP (the block's shapes) unchanged; ResBM is never
    scaled."""
    from nanotron_ext.config.loader import load_config
    from reproduce.paper_scale import Model
    from reproduce.paper_scale_plans import RUNS

    runs = ["llama_7b_btp", "llama_7b_fullrank", "boost_block2_ungrouped_bz4"]
    shapes = {s for run in runs for s, _ in layer_gemms(load_config(REPO / RUNS[run][0], list(RUNS[run][1])))}
    uniform = load_table(_table(tmp_path, [{"m": m, "k": k, "n": n, "efficiency": 0.6} for m, k, n in shapes]))
    model = Model(uniform)
    assert model.scaled("llama_7b_btp", "boost", 100.0) == pytest.approx(100.0)
    assert model.scaled("resbm_2b_baseline_pp8", "resbm", 100.0) == 100.0
    full = {s for s, _ in layer_gemms(load_config(REPO / RUNS["llama_7b_fullrank"][0], []))}
    half = load_table(_table(tmp_path, [{"m": m, "k": k, "n": n, "efficiency": 0.8 if (m, k, n) in full else 0.4}
                                        for m, k, n in shapes]))
    # the fit's run (the CoLA 7B block, BTP) and llama_7b_btp have the same layer: no change; full rank is faster
    model = Model(half)
    assert model.scaled("llama_7b_btp", "boost", 100.0) == pytest.approx(100.0)
    assert model.scaled("llama_7b_fullrank", "boost", 100.0) == pytest.approx(200.0)
