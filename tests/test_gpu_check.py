"""`make gpu-check` (benchmarks/gpu_check.py) without a GPU: its plan loads, its verdicts can fail, its
plain-PyTorch reference is the same function as our model, `model.compile` changes nothing but speed, and the
whole plan runs on CPU (the dry run, slow)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.helpers.dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_check_memory  # noqa: E402
import gpu_check_plan  # noqa: E402
import gpu_check_report  # noqa: E402

TINY = ["model.hidden_size=64", "model.ffn_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.vocab_size=512", "tokenizer.vocab_size=512", "tokens.sequence_length=32", "model.max_seq_len=32",
        "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=2"]


# ------------------------------------------------------------------------------------------------
# the plan: every technique and codec config the GPU run will load is valid, at both scales
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry"])
def test_every_planned_config_loads(dry: bool, tmp_path: Path) -> None:
    from nanotron_ext.config.loader import load_config

    s = gpu_check.settings(dry)
    base = gpu_check.technique_base(s, gpu_check.data_overrides(s, tmp_path))
    items = gpu_check.technique_items()
    assert {"full_rank", "bf16_autocast", "muon", "boost_svd_vanilla", "boost_lax_btp", "resbm", "subspace", "mapl",
            "mapl_rvq", "topk", "int8", "int4", "lowrank", "sparseloco_sim",
            "het_sparseloco_sim"} <= {i["name"] for i in items}
    for item in items:
        cfg = load_config(REPO / "examples/config_tiny_llama.yaml", base + item["overrides"] + ["general.backend=gloo"])
        assert cfg.tokens.train_steps == s["steps"]
    for name, overrides in gpu_check.CODECS.items():  # the codec stage's shape: 125M, or tiny in the dry run
        cfg = load_config(REPO / "examples/config_125m_gpu.yaml",
                          s["throughput"] + overrides + ["model.num_layers=2", "model.codec.boundaries=[0]"])
        assert cfg.model.codec.kind == (overrides[0].split("=")[1] if overrides else "identity"), name
    for item in gpu_check_plan.memory_items(s):  # the 125M and 1B rows as the throughput and memory stages load them
        cfg = load_config(REPO / item["config_file"], item["overrides"] + ["general.backend=gloo"])
        assert cfg.model.compile and cfg.model.attention == "sdpa", item["name"]
        if not dry:
            assert (cfg.model.hidden_size, cfg.model.num_layers) == {"125m": (768, 12), "1b": (2048, 24)}[item["name"]]
        # what the trainer's device step guard needs (nanotron_ext.train.step_guard.guard_path): AdamW, fused on CUDA
        # by default (asked for by name in the dry run), the all-reduce DP sync, no output constraint
        assert cfg.general.step_guard == "auto" and cfg.optimizer.name == "adamw", item["name"]
        assert cfg.optimizer.adamw_impl == ("fused" if dry else "auto"), item["name"]
        assert cfg.parallelism.dp_sync == "allreduce" and cfg.model.output_constraint.kind == "none", item["name"]


def test_default_budgets_fit_one_command() -> None:
    """Issue 40: throughput and profile first, then the 1B row and the memory stage; every stage in one command of
    at most 540 s (deadlines add up, so the run ends by the budgets' sum plus the last job's grace to stop)."""
    from gpu_check_runner import STOP_GRACE_S

    assert gpu_check.STAGES[:4] == ("throughput", "profile", "throughput_1b", "memory")
    assert set(gpu_check_plan.BUDGET_S) == set(gpu_check.STAGES) == set(gpu_check_plan.DRY_BUDGET_S)
    # make gpu-check installs the carried wheels first (seconds) and writes the report after the last stage
    assert sum(gpu_check_plan.BUDGET_S[s] for s in gpu_check.DEFAULT_STAGES) + STOP_GRACE_S + 20 <= 540
    assert gpu_check.BUDGET_S["gemm"] + STOP_GRACE_S + 20 <= 540  # the gemm stage: a call of its own
    assert set(gpu_check.STAGE_FUNCS) == set(gpu_check.STAGES)
    assert gpu_check_plan.TARGETS == {"throughput": {"ratio": 1.0, "mfu": 0.40}, "throughput_1b": {"ratio": 1.0,
                                                                                                    "mfu": 0.45}}


def test_memory_verdicts() -> None:
    """Eager: planned / measured within 10%; compiled: the plan an upper bound; a config without either figure is not
    compared, and the stage is partial (failed when its job failed)."""
    def row(name: str, eager: int, compiled: int) -> Dict[str, Any]:
        return {"name": name, "status": "ok", "phases": {"eager": {"peak_bytes": eager},
                                                         "compiled": {"peak_bytes": compiled}}}

    rows = [row("a", 100, 90), row("b", 100, 120), row("d", 100, 90), {"name": "c", "status": "failed", "error": "x"}]
    plans = {"a": {"peak_bytes": 105}, "b": {"peak_bytes": 111}, "c": {"peak_bytes": 1}, "d": {"error": "rc 1"}}
    got = {(c["name"], c.get("phase")): c["verdict"] for c in gpu_check_memory.compare(rows, plans)}
    assert got == {("a", "eager"): "within", ("a", "compiled"): "upper bound", ("b", "eager"): "NOT within",
                   ("b", "compiled"): "NOT an upper bound", ("d", None): "not compared", ("c", None): "not compared"}

    def status(n: int) -> str:
        return gpu_check_report.stage_status("memory", {"rows": rows[:n],
                                                        "comparison": gpu_check_memory.compare(rows[:n], plans)})

    assert (status(2), status(3), status(4)) == ("ok", "partial", "failed")  # a missed goal is a verdict, not a failure


# ------------------------------------------------------------------------------------------------
# the CUDA-vs-CPU verdicts fail when they should
# ------------------------------------------------------------------------------------------------
def _row(name: str, losses: List[float], **kw: Any) -> Dict[str, Any]:
    return {"name": name, "status": "ok", "dtype": kw.pop("dtype", "fp32"), "losses": losses,
            "comm_bytes": [{"world": 4}] * len(losses), "wire_bytes_per_step": 1024, "misplaced": [], **kw}


def test_compare_halves_verdicts() -> None:
    tol = {"fp32": 1e-3, "bf16": 1e-2}
    cpu = [_row("same", [8.0, 7.0]), _row("off", [8.0, 7.0]), _row("bytes", [8.0, 7.0]), _row("placed", [8.0, 7.0]),
           _row("bf16", [8.0, 7.0], dtype="bf16"), _row("broken", [8.0, 7.0])]
    dev = [_row("same", [8.0, 7.0 * (1 + 5e-4)]), _row("off", [8.0, 7.0 * (1 + 2e-3)]),
           _row("bytes", [8.0, 7.0], wire_bytes_per_step=2048), _row("placed", [8.0, 7.0], misplaced=["w@cpu"]),
           _row("bf16", [8.0, 7.0 * (1 + 5e-3)], dtype="bf16"), {"name": "broken", "status": "failed", "error": "x"}]
    verdicts = {r["name"]: r["verdict"] for r in gpu_check_report.compare_halves(dev, cpu, tol)}
    assert verdicts == {"same": "pass", "off": "FAIL", "bytes": "FAIL", "placed": "FAIL", "bf16": "pass",
                        "broken": "not compared"}
    body = {"rows": {"device": dev, "cpu": cpu}, "comparison": gpu_check_report.compare_halves(dev, cpu, tol)}
    assert gpu_check_report.stage_status("techniques", body) == "failed"
    ok = [_row("same", [8.0, 7.0])]
    body = {"rows": {"device": ok, "cpu": ok}, "comparison": gpu_check_report.compare_halves(ok, ok, tol)}
    assert gpu_check_report.stage_status("techniques", body) == "ok"
    skipped = ok + [{"name": "late", "status": "skipped", "note": "budget"}]
    body = {"rows": {"device": skipped, "cpu": ok}, "comparison": gpu_check_report.compare_halves(skipped, ok, tol)}
    assert gpu_check_report.stage_status("techniques", body) == "partial"


def test_profile_kinds_of_the_h200_kernels() -> None:
    """Kernel names as the H200 profile printed them (benchmarks/results/gpu/2026-11-27-h200/call2/profile)."""
    import gpu_check_jobs

    kinds = {"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Fl...": "attention",
             "fmha_cutlassF_f32_aligned_64x64_rf_sm80": "attention",
             "triton_poi_fused__unsafe_view_cat_mul_silu_silu_backward_split_view_1": "fused elementwise (compiled)",
             "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float>": "loss",
             "triton_red_fused__log_softmax_backward_data_nll_loss_backward_0": "loss",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer and "
             "clipping",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
             "Memcpy DtoD (Device -> Device)": "copies and casts",
             "void at::native::elementwise_kernel<128, 2, ...direct_copy_kernel_cuda...>": "copies and casts",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other"}
    assert {name: gpu_check_jobs.kind_of(name) for name in kinds} == kinds


def test_cudnn_attention_needs_cuda() -> None:
    import torch

    from nanotron_ext.models.layers import causal_attention

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="model.attention='cudnn'.*CUDA"):
        causal_attention(q, q, q, backend="cudnn")


def test_discrete_codec_checks() -> None:
    """mapl_rvq is judged against the CPU run that replays the device's codes (the unpinned one may drift), and its
    code disagreement has a limit; topk's step 1 must agree tightly, later steps within its own tolerance."""
    tol = {"fp32": 1e-3, "bf16": 1e-2}
    pin = {"pin_codes": True, "max_code_disagreement": 1e-2}
    topk = {"first_tolerance": 1e-5, "tolerance": 1e-2}
    dev = [_row("rvq", [8.0, 7.0], check=pin), _row("rvq_flips", [8.0, 7.0], check=pin),
           _row("rvq_drifts", [8.0, 7.0], check=pin), _row("topk", [8.0, 7.0 * (1 + 5e-3)], check=topk),
           _row("topk_step1", [8.0 * (1 + 1e-4), 7.0], check=topk)]
    cpu = [_row(r["name"], [8.0, 7.0 * (1 + 8e-3)]) for r in dev[:3]] + [_row("topk", [8.0, 7.0]),
                                                                          _row("topk_step1", [8.0, 7.0])]
    pinned = [_row("rvq", [8.0, 7.0], code_disagreement=2e-3), _row("rvq_flips", [8.0, 7.0], code_disagreement=0.2),
              _row("rvq_drifts", [8.0, 7.0 * (1 + 2e-3)], code_disagreement=0.0)]
    rows = {r["name"]: r for r in gpu_check_report.compare_halves(dev, cpu, tol, pinned)}
    assert {n: r["verdict"] for n, r in rows.items()} == {"rvq": "pass", "rvq_flips": "FAIL", "rvq_drifts": "FAIL",
                                                          "topk": "pass", "topk_step1": "FAIL"}
    assert rows["rvq"]["pinned"] and rows["rvq"]["unpinned_worst_rel"] == pytest.approx(8e-3 / (1 + 8e-3))
    missing = gpu_check_report.compare_halves(dev[:1], cpu[:1], tol, [])  # no pinned run: not judged against cpu
    assert missing[0]["verdict"] == "not compared"
    assert set(gpu_check.DISCRETE_CHECKS) == {"mapl_rvq", "topk"}
    items = {i["name"]: i for i in gpu_check.technique_items()}
    assert items["mapl_rvq"]["pin_codes"] and items["topk"]["first_tolerance"] == 1e-5


# ------------------------------------------------------------------------------------------------
# the plain-PyTorch reference is the same function as nanotron_ext's model (fp32, through training steps)
# ------------------------------------------------------------------------------------------------
def _plain_vs_ours() -> Dict[str, List[List[float]]]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plain_llama as pl

    from nanotron_ext.bench import workload as bw
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import evaluate

    ctx = build_parallel_context(1, 1, 1, backend="gloo")
    out: Dict[str, List[List[float]]] = {}
    for tie in ("true", "false"):
        cfg = bw.resolve_config(None, TINY + [f"model.tie_embeddings={tie}"])
        ours = bw.build_trainee(cfg, ctx)
        plain = pl.PlainLlama(cfg.model)
        plain.load_from(ours.model)
        opt = pl.make_optimizer(plain, cfg.optimizer)
        batches = bw.random_micro_batches(cfg, 2)
        out[tie] = []
        for _ in range(3):
            out[tie].append([evaluate(ours.model, ours.engine, batches, ctx).item(),
                             pl.eval_loss(plain, batches, bf16=False)])
            bw.train_iteration(ours, ctx, batches)
            pl.train_step(plain, opt, batches, cfg.optimizer.clip_grad, bf16=False)
    return out


def test_plain_reference_is_the_same_model() -> None:
    """Tied and untied head: the loss before each of 3 AdamW steps agrees to fp32 rounding."""
    for tie, losses in run_distributed(_plain_vs_ours, 1)[0].items():
        assert losses[0][0] > losses[-1][0] + 0.05, tie  # it trains: the comparison below is not of constants
        for ours, plain in losses:
            assert plain == pytest.approx(ours, rel=1e-5), tie


def _trainer_step(impl: str) -> Dict[str, Any]:
    import torch
    from gpu_check_pair import TrainerStep

    from nanotron_ext.bench import workload as bw
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(1, 1, 1, backend="gloo")
    ours = TrainerStep(bw.resolve_config(None, TINY + [f"optimizer.adamw_impl={impl}"]), ctx)
    batches = bw.random_micro_batches(ours.cfg, 2)
    for _ in range(2):
        ours(batches)
    ours.finish()
    out: Dict[str, Any] = {"path": ours.path, "steps": ours.step, "error": None}
    with torch.no_grad():  # a diverged model: its next step is refused, and the row must not time it
        next(ours.model.parameters()).fill_(float("nan"))
    try:
        ours(batches)
        ours.finish()
    except RuntimeError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("impl,where", [("fused", "on the device"), ("for_loop", "on the host")])
def test_ours_takes_the_trainers_step_and_guard(impl: str, where: str) -> None:
    """The throughput rows time ours through the trainer's Replica and step guard: on the device with the fused
    AdamW (CUDA's default), on the host otherwise; a refused step stops the row either way."""
    out = run_distributed(_trainer_step, 1, impl)[0]
    assert out["path"].startswith(f"step guard: {where}") and out["steps"] == 2, out
    assert out["error"] and out["error"].startswith("step 3: not finite"), out


# ------------------------------------------------------------------------------------------------
# model.compile: the decoder layers are compiled in place, the numbers do not change
# ------------------------------------------------------------------------------------------------
def _compiled_vs_eager() -> Dict[str, Any]:
    import functools

    import torch

    # inductor's C++ code generation takes ~30 s here; AOT autograd traces the same graph (what breaks)
    torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
    from nanotron_ext.bench import workload as bw
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import forward_backward

    ctx = build_parallel_context(1, 1, 1, backend="gloo")
    out: Dict[str, Any] = {}
    for flag in ("false", "true"):
        cfg = bw.resolve_config(None, TINY + [f"model.compile={flag}"])
        t = bw.build_trainee(cfg, ctx, with_optimizer=False)
        loss = forward_backward(t.model, t.engine, bw.random_micro_batches(cfg, 2), ctx)
        out[flag] = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in t.model.named_parameters()},
                     "compiled": [getattr(b.pp_block, "_compiled_call_impl", None) is not None
                                  for b in [*t.model.decoder, t.model.loss]],
                     "names": sorted(t.model.state_dict())}
    return out


def test_model_compile_matches_eager() -> None:
    import torch

    out = run_distributed(_compiled_vs_eager, 1)[0]
    eager, compiled = out["false"], out["true"]
    # the decoder layers and, at TP = 1, the loss (torch's cross-entropy in place of nanotron's sharded one)
    assert compiled["compiled"] == [True, True, True] and eager["compiled"] == [False, False, False]
    assert compiled["names"] == eager["names"]  # checkpoints are unchanged by compiling
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-6)
    for name, g in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------
# the dry run: the whole plan on CPU (a subset of the techniques, so it stays near a minute idle)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_runs_the_whole_plan(tmp_path: Path) -> None:
    # one item per kind of work (plain, BOOST, each codec family, an outer loop); every item's config loads above
    only = "full_rank,boost_lax_btp,resbm,mapl_rvq,int4,het_sparseloco_sim"
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--dry-run", "--only", only,
                           "--work", str(tmp_path / "work"), "--out", str(out), "--steps", "2",
                           # the GPU budgets are for GPU sessions; a loaded CI machine must not skip anything
                           *[f"--budget={stage}=600" for stage in gpu_check.STAGES]],
                          capture_output=True, text=True, cwd=REPO, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    stages = result["stages"]
    assert result["meta"]["dry_run"] is True
    assert list(stages) == list(gpu_check.DEFAULT_STAGES)  # in the order they ran (gemm runs only when named)
    assert {s: b["status"] for s, b in stages.items()} == {s: "ok" for s in gpu_check.DEFAULT_STAGES}
    comparison = stages["techniques"]["comparison"]
    assert sorted(r["name"] for r in comparison) == sorted(only.split(","))
    assert all(r["verdict"] == "pass" and r["bytes_identical"] for r in comparison)
    assert next(r for r in comparison if r["name"] == "resbm")["wire_bytes_per_step"] > 0
    rvq = next(r for r in comparison if r["name"] == "mapl_rvq")  # CPU on both sides: the replayed codes are its own
    assert rvq["pinned"] and rvq["code_disagreement"] == 0 and rvq["worst_rel"] == 0
    assert next(r for r in comparison if r["name"] == "het_sparseloco_sim")["sync_bytes"]
    for stage in ("throughput", "throughput_1b"):  # the 125M rows and the 1B row (tiny here)
        assert stages[stage]["rows"], stage
        for row in stages[stage]["rows"]:
            first = row["first_loss"]
            assert first["plain"] == pytest.approx(first["nanotron_ext"], rel=1e-2), row["name"]  # bf16: same function
            # both use the configured AdamW (fused: asked for in the dry run, CUDA's default), ours the trainer's
            # step with the guard on the device
            assert row["optimizers"] == {"nanotron_ext": "AdamW (fused)", "plain": "AdamW (fused)"}, row["name"]
            assert row["step_guard"].startswith("step guard: on the device"), row["name"]
            assert row["ratio"] > 0 and row["models"]["nanotron_ext"]["tokens_per_s"] > 0, row["name"]
    assert stages["throughput_1b"]["config"] == gpu_check_plan.CONFIG_1B
    assert [r["name"] for r in stages["throughput_1b"]["rows"]] == ["flash_compile"]  # cuDNN: CUDA only
    memory = stages["memory"]  # the planner (--device cpu here) against the CPU allocator, eager and compiled
    assert {(c["name"], c["phase"]) for c in memory["comparison"]} == {(n, p) for n in ("125m", "1b")
                                                                       for p in ("eager", "compiled")}
    for c in memory["comparison"]:  # tests/test_plan.py holds the planner to the CPU allocator within 10% too
        assert c["verdict"] == ("within" if c["phase"] == "eager" else "upper bound"), c
    assert memory["planned_for"] == "cpu" and all(p["device"] == "cpu" for p in memory["plans"].values())
    assert all(r["step_guard"].startswith("step guard: on the device") for r in memory["rows"])
    assert {r["name"] for r in stages["codecs"]["rows"]} == {"resbm", "mapl_rvq", "int4"}
    assert "fig7" in stages["boost"] and "table3" in stages["boost"]
    for stem in ("boost_fig7", "boost_table3"):  # the BOOST scripts' own outputs (fig7 is smoke-tested only here)
        work = tmp_path / "work"
        assert (work / f"{stem}.png").exists() and (work / f"{stem}.md").exists(), stem
        data = json.loads((work / f"{stem}.json").read_text())
        assert data["rows"] and data["paper"] and any(p["held"] is not None for p in data["paper"]), stem
    profiled = stages["profile"]["rows"][0]
    assert profiled["step_guard"].startswith("step guard: on the device")
    for name, model in profiled["models"].items():  # the kinds partition the profiled time
        assert {"gemm", "attention"} <= set(model["kinds_ms"]), name
        assert sum(model["kinds_ms"].values()) == pytest.approx(model["busy_ms"]), name
        assert model["top"][0]["ms"] >= model["top"][-1]["ms"] > 0, name
    md = (out / "gpu_check.md").read_text()
    assert "## 1B throughput" in md and "## The planner against the allocator" in md
    assert (out / "gpu_check.png").stat().st_size > 0
