"""BOOST benchmarks and reproduce configs: Table 8 YAMLs, the analytic parameter count against built
models, the pure table-building code of the drivers, and (slow) smoke runs of the drivers."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
REPRO = REPO / "reproduce" / "boost"
sys.path.insert(0, str(BENCH))

import boost_common as bc  # noqa: E402
import boost_iter_compare as ic  # noqa: E402
import boost_table3_grouping as t3  # noqa: E402
import boost_table5_checkpointing as t5  # noqa: E402


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


make_configs = _load(REPRO / "make_configs.py", "boost_make_configs")
param_counts = _load(REPRO / "param_counts.py", "boost_param_counts")
YAMLS = sorted(REPRO.glob("llama_*.yaml"))


# ------------------------------------------------------------------------------------------------
# reproduce/boost configs
# ------------------------------------------------------------------------------------------------
def test_every_table8_size_and_variant_has_a_config() -> None:
    expected = {f"llama_{s}_{v}.yaml" for s in make_configs.TABLE8 for v in make_configs.VARIANTS}
    assert {p.name for p in YAMLS} == expected


def test_committed_configs_match_their_generator() -> None:
    assert make_configs.main(["--check"]) == 0


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_reproduce_config_loads_and_matches_table8(path: Path) -> None:
    from nanotron_ext.config import load_config

    cfg = load_config(path)
    size, variant = path.stem.split("_")[1:]
    layers, heads, d, dff, r = make_configs.TABLE8[size]
    m = cfg.model
    assert (m.num_layers, m.num_heads, m.hidden_size, m.ffn_size) == (layers, heads, d, dff)
    assert m.num_kv_heads == m.num_heads
    if variant == "fullrank":
        assert m.low_rank.kind == "none" and m.boost.tp_strategy == "megatron"
    else:
        assert m.low_rank.kind == "cola" and m.rank == r == d // 4
        assert m.boost.tp_strategy == variant
    p = cfg.parallelism
    cfg.validate(world_size=p.dp * p.tp * p.pp)  # the layout fits the shapes (heads, d_ff, vocab % tp)


def test_config_show_cli_accepts_the_reproduce_configs(capsys: pytest.CaptureFixture) -> None:
    from nanotron_ext.config.__main__ import main

    for path in YAMLS:
        assert main(["show", "--config-file", str(path)]) == 0
    assert "tp_strategy: btp" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# analytic parameter count
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_linear_params_equal_the_papers_dp_volume(path: Path) -> None:
    """Table 6's DP row is the gradient (= linear parameter) count: l(4d^2 + 3 d d_ff) full rank,
    l(11 d r + 3 d_ff r) low rank (MHA)."""
    from nanotron_ext.config import load_config

    m = load_config(path).model
    counts = param_counts.analytic_params(m)
    l, d, f, r = m.num_layers, m.hidden_size, m.ffn_size, m.rank
    paper = l * (4 * d * d + 3 * d * f) if m.low_rank.kind == "none" else l * (11 * d * r + 3 * f * r)
    assert counts["attention"] + counts["mlp"] == paper


def test_llama2_7b_and_13b_full_rank_counts_are_the_published_ones() -> None:
    from nanotron_ext.config import load_config

    # LLaMA-2-7B / 13B (vocab 32000, untied head) have 6,738,415,616 / 13,015,864,320 parameters
    assert param_counts.analytic_params(load_config(REPRO / "llama_7b_fullrank.yaml").model)["total"] == 6_738_415_616
    assert param_counts.analytic_params(load_config(REPRO / "llama_13b_fullrank.yaml").model)["total"] == 13_015_864_320


def test_analytic_count_equals_built_models_for_every_registered_strategy() -> None:
    records = param_counts.check_built()
    registered, _ = bc.available_strategies()
    assert {r["strategy"] for r in records} == set(registered)
    assert {r["kind"] for r in records if r["strategy"] != "megatron"} <= {"svd", "cola", "lax"}
    bad = [r for r in records if r["analytic"] != r["built"]]
    assert not bad, bad
    assert len(records) >= len(param_counts.CHECK_SHAPES)


# ------------------------------------------------------------------------------------------------
# pure functions of the drivers
# ------------------------------------------------------------------------------------------------
def test_summarize_drops_warmup_and_uses_sample_std() -> None:
    times = [9.0, 7.0, 1.0, 2.0, 3.0, 6.0]
    s = bc.summarize(times, warmup=2)
    assert s.n == 4
    assert s.mean == pytest.approx(3.0)
    assert s.std == pytest.approx(statistics.stdev([1.0, 2.0, 3.0, 6.0]))
    assert s.median == pytest.approx(2.5)
    assert (s.min, s.max) == (1.0, 6.0)
    assert s.sem == pytest.approx(s.std / 2)
    assert bc.summarize([4.0], 0).std == 0.0
    with pytest.raises(ValueError):
        bc.summarize([1.0, 2.0], warmup=2)
    with pytest.raises(ValueError):
        bc.summarize([1.0], warmup=-1)


def test_speedup_and_its_standard_error() -> None:
    ref = bc.summarize([2.0, 2.2, 1.8, 2.0], 0)
    cand = bc.summarize([1.0, 1.1, 0.9, 1.0], 0)
    s, err = bc.speedup(ref, cand)
    assert s == pytest.approx(2.0)
    rel = math.hypot(ref.sem / ref.mean, cand.sem / cand.mean)
    assert err == pytest.approx(2.0 * rel)
    assert bc.speedup(cand, cand)[0] == pytest.approx(1.0)


def test_pooled_summary_drops_warmup_of_every_round() -> None:
    s = ic.pooled_summary([[100.0, 1.0, 3.0], [50.0, 5.0, 7.0]], warmup=1)
    assert s.n == 4 and s.mean == pytest.approx(4.0)


def test_table6_closed_forms() -> None:
    b, s, d, f, r = 2, 8, 16, 40, 4
    assert bc.table6_tp_elements("megatron", b, s, d, f, r) == 2 * b * s * d
    assert bc.table6_tp_elements("vanilla", b, s, d, f, r) == 5 * b * s * d + 2 * b * s * f
    assert bc.table6_tp_elements("btp", b, s, d, f, r) == 7 * b * s * r
    with pytest.raises(ValueError):
        bc.table6_tp_elements("zero", b, s, d, f, r)


def _result(name: str, strategy: str, times: List[float], status: str = "ok") -> Dict[str, Any]:
    if status != "ok":
        return {"name": name, "strategy": strategy, "status": status}
    return {"name": name, "strategy": strategy, "status": "ok", "rounds": [times], "cpu_rounds": [[t / 2 for t in times]],
            "block": {"fwd": {"bytes": 100, "calls": 2}, "bwd": {"bytes": 80, "calls": 2}},
            "tp_calls_per_iter": 22.0, "tp_bytes_per_iter": 1e6, "peak_memory_bytes": 2**20,
            "shape": {"b": 2, "s": 8, "d": 16, "d_ff": 40, "r": 4, "elem_bytes": 4}}


def test_build_rows_computes_means_and_speedups_on_synthetic_timings() -> None:
    results = [
        _result("full", "megatron", [9.0, 3.0, 3.0, 3.0]),
        _result("van", "vanilla", [9.0, 4.0, 4.0, 4.0]),
        _result("boost", "btp", [9.0, 2.0, 2.0, 2.0]),
        _result("gone", "btp", [], status="not available (tp_strategy 'btp' not registered)"),
    ]
    rows = ic.build_rows(results, warmup=1)
    by = {r["name"]: r for r in rows}
    assert by["van"]["mean_s"] == pytest.approx(4.0) and by["van"]["std_s"] == 0.0
    assert by["boost"]["speedup_vs_vanilla"] == pytest.approx(2.0)
    assert by["boost"]["speedup_vs_megatron"] == pytest.approx(1.5)
    assert by["full"]["speedup_vs_vanilla"] == pytest.approx(4 / 3)
    assert by["van"]["speedup_vs_vanilla"] == pytest.approx(1.0)
    assert by["boost"]["cpu_mean_s"] == pytest.approx(1.0)
    assert by["boost"]["table6_bytes_per_block_per_pass"] == 7 * 2 * 8 * 4 * 4
    assert by["van"]["table6_bytes_per_block_per_pass"] == (5 * 2 * 8 * 16 + 2 * 2 * 8 * 40) * 4
    assert by["gone"]["status"].startswith("not available") and "mean_s" not in by["gone"]
    text = ic.render(rows)
    assert "not available" in text and "2.00x" in text
    lines = ic.verdicts(rows)
    assert any("MET" in ln and "boost" in ln for ln in lines)


def test_build_rows_without_reference_rows_leaves_speedups_empty() -> None:
    rows = ic.build_rows([_result("boost", "btp", [1.0, 2.0, 2.0]),
                          _result("van", "vanilla", [], status="failed (rc=1): boom")], warmup=1)
    assert rows[0]["speedup_vs_vanilla"] is None and rows[0]["speedup_vs_megatron"] is None
    assert "failed" in ic.render(rows)


def test_online_vs_sync_verdict_uses_the_means() -> None:
    on = _result(ic.variant_name("btp", "online"), "btp", [5.0, 1.0, 1.1, 0.9])
    sy = _result(ic.variant_name("btp", "sync"), "btp", [5.0, 1.2, 1.3, 1.1])
    lines = ic.verdicts(ic.build_rows([on, sy], warmup=1))
    assert any("Online vs Sync" in ln and "MET" in ln and "NOT" not in ln for ln in lines)


def test_plan_expands_rmsnorm_both_into_two_btp_rows() -> None:
    args = SimpleNamespace(strategies="megatron,vanilla,btp", rmsnorm="both")
    assert [(s, m) for _, s, m in ic.plan(args)] == [("megatron", None), ("vanilla", None), ("btp", "online"), ("btp", "sync")]
    args = SimpleNamespace(strategies="btp", rmsnorm="sync")
    assert [(s, m) for _, s, m in ic.plan(args)] == [("btp", "sync")]
    with pytest.raises(SystemExit):
        ic.plan(SimpleNamespace(strategies="zero", rmsnorm="both"))


def test_split_argv_and_torchrun_command() -> None:
    assert bc.split_argv(["--iters", "3", "--", "--nproc_per_node", "8"]) == (["--iters", "3"], ["--nproc_per_node", "8"])
    assert bc.split_argv(["--iters", "3"]) == (["--iters", "3"], [])
    cmd = bc.torchrun_command([], "x.py", ["--worker"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[4:6] == ["--nproc_per_node", "2"] and cmd[-2:] == ["x.py", "--worker"]
    multi = bc.torchrun_command(["--nnodes", "2", "--rdzv-endpoint=h:1"], "x.py", [])
    assert "--standalone" not in multi


def test_shape_overrides_default_only_without_a_config_file() -> None:
    keys = {k: None for k in bc.SHAPE_KEYS}
    plain = bc.shape_overrides(SimpleNamespace(config_file=None, **keys))
    assert f"model.hidden_size={bc.BENCH_DEFAULTS['hidden']}" in plain
    assert f"model.num_kv_heads={bc.BENCH_DEFAULTS['heads']}" in plain
    assert not any(o.startswith("model.low_rank.rank") for o in plain)
    cfg = bc.resolve_config(None, plain + bc.strategy_overrides("btp", "cola", "sync"))
    assert cfg.model.rank == bc.BENCH_DEFAULTS["hidden"] // 4 and cfg.model.boost.rmsnorm == "sync"
    with_file = bc.shape_overrides(SimpleNamespace(config_file="x.yaml", **{**keys, "micro_batch": 1}))
    assert with_file == ["tokens.micro_batch_size=1"]
    assert bc.strategy_overrides("megatron", "cola") == ["model.low_rank.kind=none", "model.boost.tp_strategy=megatron"]


def test_write_rows_json_and_csv(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": {"x": 2}}, {"a": 3, "c": None}]
    js = bc.write_rows(tmp_path / "t.json", rows, {"machine": "m"})
    assert json.loads(js.read_text()) == {"meta": {"machine": "m"}, "rows": rows}
    cs = bc.write_rows(tmp_path / "t.csv", rows)
    got = list(csv.DictReader(cs.open()))
    assert got[0]["a"] == "1" and json.loads(got[0]["b"]) == {"x": 2} and got[1]["c"] == ""


def test_format_table_aligns_columns() -> None:
    text = bc.format_table(["name", "value"], [["a", 1], ["long name", None]])
    lines = text.splitlines()
    assert len({len(ln) for ln in lines}) == 1
    assert lines[3].rstrip().endswith("-")


def test_table5_compare_on_synthetic_rows() -> None:
    def raw(variant: str, act: int, t: float, calls: int) -> Dict[str, Any]:
        return {"variant": variant, "micro_batch": 4, "times": [9.0, t, t], "cpu_times": [9.0, t / 2, t / 2],
                "tp_calls": calls, "act_alloc": act, "act_saved": act - 1}

    rows = t5.compare([raw("btp/ckpt-off", 300 * 2**20, 0.010, 37), raw("btp/ckpt-on", 100 * 2**20, 0.012, 37),
                       raw("vanilla/ckpt-off", 400 * 2**20, 0.010, 37), raw("vanilla/ckpt-on", 100 * 2**20, 0.010, 41)],
                      warmup=1)
    by = {r["strategy"]: r for r in rows}
    assert by["btp"]["d_mem_bytes"] == 200 * 2**20
    assert by["btp"]["d_time_s"] == pytest.approx(0.002)
    assert by["btp"]["eff_mib_per_ms"] == pytest.approx(100.0)
    assert by["btp"]["eff_cpu_mib_per_ms"] == pytest.approx(200.0)
    assert by["vanilla"]["eff_mib_per_ms"] is None  # no measurable extra time
    assert by["vanilla"]["extra_tp_calls"] == 4 and by["btp"]["extra_tp_calls"] == 0
    assert [r["strategy"] for r in rows] == ["vanilla", "btp"]
    assert "+4" in t5.render(rows)


def test_table3_compare_on_synthetic_rows() -> None:
    def raw(variant: str, t: float, comm: float, calls: int) -> Dict[str, Any]:
        return {"variant": variant, "micro_batch": 1, "part": "block", "times": [1.0, t, t],
                "comm_s": [0.5, comm, comm], "tp_calls": calls, "tp_bytes": 10}

    rows = t3.compare([raw("ungrouped", 0.004, 0.002, 14), raw("grouped", 0.002, 0.001, 8)], warmup=1)
    (r,) = rows
    assert r["speedup"] == pytest.approx(2.0)
    assert r["comm_speedup"] == pytest.approx(2.0)
    assert r["comp_ungrouped_s"] == pytest.approx(0.002) and r["comp_speedup"] == pytest.approx(2.0)
    assert "14/8" in t3.render(rows)


# ------------------------------------------------------------------------------------------------
# slow: the drivers end to end (2 gloo processes)
# ------------------------------------------------------------------------------------------------
TINY = ["--hidden", "64", "--layers", "1", "--heads", "2", "--ffn", "160", "--vocab", "512", "--seq", "32",
        "--micro-batch", "1"]


def _run(cmd: List[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["separate", "interleaved"])
def test_iter_compare_smoke(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "table.json"
    proc = _run(["bash", str(REPO / "run_iter_compare.sh"), "--iters", "3", "--warmup", "1", "--mode", mode,
                 "--out", str(out), "--log-dir", str(tmp_path / "logs"), *TINY])
    assert "BOOST iteration comparison" in proc.stdout
    data = json.loads(out.read_text())
    registered, _ = bc.available_strategies()
    rows = {r["strategy"] + (r["name"] if r["strategy"] == "btp" else ""): r for r in data["rows"]}
    assert rows["megatron"]["status"] == "ok"
    for r in data["rows"]:
        if r["strategy"] not in registered:
            assert r["status"].startswith("not available")
            continue
        assert r["status"] == "ok" and r["n"] == 2 and r["mean_s"] > 0 and r["tp_calls_per_iter"] > 0
        closed = r["table6_bytes_per_block_per_pass"]
        if r["strategy"] in ("megatron", "vanilla"):
            assert r["tp_fwd_bytes_per_block"] == closed  # the ledger measures exactly Table 6 (MHA)
        else:  # btp: 7bsr plus the RMSNorm statistic (one fp32 per token per norm)
            b, s = data["meta"]["shape"]["b"], data["meta"]["shape"]["s"]
            assert r["tp_fwd_bytes_per_block"] == closed + 2 * b * s * 4
            assert r["tp_bwd_bytes_per_block"] == closed + (2 * b * s * 4 if "sync" in r["name"] else 0)
    if "vanilla" in registered:
        assert rows["megatron"]["speedup_vs_vanilla"] is not None


@pytest.mark.slow
def test_table4_and_table5_smoke(tmp_path: Path) -> None:
    if not {"vanilla", "btp"} <= set(bc.available_strategies()[0]):
        pytest.skip("vanilla/btp not registered")
    out4 = tmp_path / "t4.json"
    _run([sys.executable, str(BENCH / "boost_table4_memory.py"), "--out", str(out4), *TINY])
    rows = {r["name"]: r for r in json.loads(out4.read_text())["rows"]}
    van, btp = rows["vanilla low-rank TP"]["rank0"], rows["BOOST btp"]["rank0"]
    # same factorised model: weights equal up to the norm weights btp shards and vanilla replicates
    assert btp["weights"] <= van["weights"] < 1.01 * btp["weights"]
    for r in (van, btp):  # AdamW: two moments per weight (+ a step counter per tensor)
        assert r["optimizer"] == pytest.approx(2 * r["weights"], rel=0.01) and r["grads"] == r["weights"]
    assert btp["act_alloc"] > 0 and btp["act_saved"] > 0
    out5 = tmp_path / "t5.json"
    _run([sys.executable, str(BENCH / "boost_table5_checkpointing.py"), "--iters", "3", "--warmup", "1",
          "--batches", "1", "--out", str(out5), *TINY])
    rows5 = json.loads(out5.read_text())["rows"]
    assert {r["strategy"] for r in rows5} == {"vanilla", "btp"}
    for r in rows5:
        assert r["d_mem_bytes"] > 0  # checkpointing keeps less for backward
        assert r["extra_tp_calls"] == 0  # the low-rank re-forward issues no collective


@pytest.mark.slow
def test_param_counts_script_checks_tp2(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    proc = _run([sys.executable, str(REPRO / "param_counts.py"), "--check-tp", "2", "--json", str(out)])
    assert "check at TP=2" in proc.stdout
    data = json.loads(out.read_text())
    assert all(c["ok"] for c in data["checks"]) and {c["tp"] for c in data["checks"]} == {1, 2}
