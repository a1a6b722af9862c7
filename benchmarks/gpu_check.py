"""`make gpu-check`: one command that proves every technique on CUDA/NCCL and measures what only a GPU shows.

    make gpu-check                        # on a GPU machine (carried wheels, patches applied): every stage, <= 540 s
    make gpu-check STAGES=throughput      # some stages; results merge into the existing result file
    make gpu-check DRY_RUN=1              # the same plan on CPU with tiny shapes (CI runs it: the plan cannot rot)
    python benchmarks/gpu_check.py --help

Stages, in the order they run (each has a time budget, --budget STAGE=SECONDS, and ends by the sum of its budget
and every earlier stage's; what does not fit is skipped with a note; results are written after each stage):

throughput  examples/config_125m_gpu.yaml (d=768, 12 layers, GQA 12/4, seq 1024, 4 x 16 sequences, bf16) with
            random tokens: nanotron_ext's training iteration against a plain-PyTorch loop of the same shape
            (benchmarks/plain_llama.py: nn.Linear, torch SDPA, same weights, same batch), iterations interleaved.
            Settings (THROUGHPUT): SDPA as torch picks it; flash or cuDNN attention + torch.compile
            (`model.compile: true`: each decoder layer and the cross-entropy; the plain loop's blocks and loss
            compiled the same way). Ours is the trainer's own step (gpu_check_pair.TrainerStep: Replica and the step
            guard, general.step_guard auto: on the device with the fused AdamW, nothing read back inside a step); the
            row records which guard path ran. Both use the same AdamW implementation (optimizer.adamw_impl: fused
            on CUDA). Figures: tokens/s of each, their
            ratio (ours / plain: the cost of our layers), MFU = tokens/s x model FLOPs per token (6 per matmul
            weight + attention, nanotron_ext.metrics.flops) / the GPU's dense bf16 peak (H100/H200: 989 TFLOP/s),
            first-iteration time (compile), peak memory, and both models' loss on the first batch (same function).
            Targets (issue 40): ratio >= 1.0 and MFU >= 40% with compile on an H100/H200 in bf16, with both
            flash and cuDNN.
profile     torch.profiler over two training iterations of ours and of the plain loop in the PROFILED throughput
            setting: each one's top kernels by device time and its device time per kind of work (GEMM, attention,
            fused elementwise, optimizer, copies and casts, loss, communication, other): where a step's time goes.
throughput_1b  The same job on reproduce/boost/llama_1b_fullrank.yaml (BOOST Table 8's full-rank LLaMA-1B: d=2048,
            24 layers, 32 heads, seq 4096, micro-batch 4, bf16; reproduce/results/PLAN.md: 56.56 GiB planned as CUDA
            allocates it), flash and cuDNN attention with compile, 8 iterations each (2 dropped). Targets (issue 40):
            ratio >= 1.0 and MFU >= 45%.
memory      The planner against the allocator (gpu_check_memory.py): `python -m nanotron_ext.plan --device cuda` of
            the 125M and the 1B configs as their compiled rows load them, run on this machine's CPU beside the
            device's measurement of the same configs built alone through the trainer's step: the peak of
            torch.cuda.max_memory_allocated over the first two steps with compile's layers switched off as the
            planner plans them (goal: planned / measured within 10%), and compiled (the plan is an upper bound).
techniques  Every technique for N steps (default 10) through the real trainer at world size 1 (NCCL on the GPU):
            full rank; bf16 autocast; Muon; BOOST SVD/CoLA/LaX with vanilla and bottleneck-aware TP (TP=1); ResBM;
            Subspace Models (fixed U and Grassmann updates); MAPL with and without residual VQ; the lossy codecs
            top-k, int8, int4, low rank (codecs after every layer, `model.codec.boundaries: every_layer`);
            SparseLoCo and heterogeneous SparseLoCo as 2 simulated replicas (sparseloco.simulate.run_simulated);
            NVTX ranges on. The same configs on CPU/gloo (CUDA hidden) run beside them. Per technique:
            the loss after every step on both, the worst relative difference against the tolerance below, and
            "bytes identical": ledger bytes per step, bytes of every codec wire per step and SparseLoCo payload
            bytes must be equal; peak GPU memory; any parameter, buffer or optimiser state found off ctx.device.
codecs      Each boundary codec alone at the throughput shape (16 x 1024 tokens, d=768, bf16): encode, decode and
            encode+decode forward+backward time per token (median), wire bytes per token (fp32 hidden: 3072).
boost       BOOST's single-GPU parts on Table 8's LLaMA-1B (its Table 8 layout is one GPU, TP=1, so one GPU holds
            exactly its shard shapes; one decoder layer built): reproduce/boost/fig7_compute.py (per-linear GEMM
            time and FLOP/s, full rank vs vanilla low rank vs BTP, utilisation; here also against the datasheet
            peak) and reproduce/boost/table3_grouping.py (grouped vs ungrouped linears, paper: 1.16x / 1.04x), plus
            Figure 7 on one unsharded LLaMA-7B layer (Table 8 runs 7B at TP=4: these GEMMs are 4x its shards').
gemm        benchmarks/gpu_check_gemm.py: the GEMM shapes of BOOST's Table 3 / Fig. 6 configs (full rank, vanilla, BTP;
            batch 1-4) and Muon's Newton-Schulz squares, bf16, each one's efficiency of the datasheet peak, written as
            gemm_efficiency.json for the model clock's --gemm-efficiency (issue 54).

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
<= 10 minutes): the default budgets (gpu_check_plan.BUDGET_S) fit every stage in one command of at most 540 s.
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

import gpu_check_gemm  # noqa: E402
import gpu_check_memory as memory  # noqa: E402
import gpu_check_report as report  # noqa: E402
from gpu_check_plan import (  # noqa: E402,F401
    BUDGET_S,
    CODECS,
    CONFIG_1B,
    DISCRETE_CHECKS,
    DRY_BUDGET_S,
    PROFILED,
    STAGES,
    TARGETS,
    THROUGHPUT,
    THROUGHPUT_1B,
    TOLERANCE,
    data_overrides,
    memory_items,
    settings,
    technique_base,
    technique_items,
)
from gpu_check_runner import STOP_GRACE_S, Run, prepare_data, run_items  # noqa: E402

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.cli_flags import one_line_refusals  # noqa: E402


# ------------------------------------------------------------------------------------------------
# stages (what runs: gpu_check_plan; how a stage's items run: gpu_check_runner)
# ------------------------------------------------------------------------------------------------
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


def _throughput_plan(run: Run, items: List[Dict[str, Any]], stage: str = "throughput") -> Dict[str, Any]:
    """The 125M rows (stage throughput, and the profile's) or the 1B rows (throughput_1b): same job, other config."""
    backend = "nccl" if run.cuda else "gloo"
    one_b = stage == "throughput_1b"
    return {"items": items, "config_file": str(REPO / (CONFIG_1B if one_b else "examples/config_125m_gpu.yaml")),
            "overrides": run.s["throughput_1b" if one_b else "throughput"] + [f"general.backend={backend}"],
            "iters": run.s["iters_1b" if one_b else "iters"], "warmup": run.s["warmup_1b" if one_b else "warmup"],
            "compile_backend": run.s["compile_backend"]}


def _throughput_rows(run: Run, deadline: float, stage: str, settings_: List[Dict[str, Any]]) -> Dict[str, Any]:
    # cuDNN attention exists on CUDA only: the dry run leaves that setting out
    plan = _throughput_plan(run, [i for i in settings_ if run.cuda or i["attention"] != "cudnn"], stage)
    rows = run_items("throughput", plan, run.work, stage, deadline - time.time(), run.args.verbose)
    return {"rows": rows, "config": str(Path(plan["config_file"]).relative_to(REPO)), "overrides": plan["overrides"],
            "targets": TARGETS[stage]}


def stage_throughput(run: Run, deadline: float) -> Dict[str, Any]:
    return _throughput_rows(run, deadline, "throughput", THROUGHPUT)


def stage_throughput_1b(run: Run, deadline: float) -> Dict[str, Any]:
    """The 1B row (issue 40, item 2): the same job and plain loop as the 125M rows, the compiled settings."""
    return _throughput_rows(run, deadline, "throughput_1b", THROUGHPUT_1B)


def stage_memory(run: Run, deadline: float) -> Dict[str, Any]:
    """The planner against the allocator (issue 40, item 3; benchmarks/gpu_check_memory.py): the planner on this
    machine's CPU beside the device's measurement of the same configs."""
    backend = ["general.backend=" + ("nccl" if run.cuda else "gloo")]
    items = memory_items(run.s)
    plan = {"items": items, "overrides": backend, "compile_backend": run.s["compile_backend"]}
    device = "cuda" if run.cuda else "cpu"  # the dry run's allocator is the CPU's
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        planned = pool.submit(memory.plan_items, items, backend, run.work, device, deadline)
        rows = run_items("memory", plan, run.work, "memory", deadline - time.time(), run.args.verbose)
        plans = planned.result()
    return {"rows": rows, "plans": plans, "planned_for": device, "tolerance": memory.TOLERANCE,
            "comparison": memory.compare(rows, plans)}


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
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    timeout=left + STOP_GRACE_S).returncode
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
    "profile": stage_profile, "throughput_1b": stage_throughput_1b, "memory": stage_memory}
# issue 54: the GEMM shapes' efficiency table the model clock reads (--gemm-efficiency), the last stage; a call of
# its own (STAGES=gemm, ~25 s): the default run's stages already fill one 540 s command
DEFAULT_STAGES = STAGES
STAGES = gpu_check_gemm.register(STAGES, STAGE_FUNCS, BUDGET_S, DRY_BUDGET_S)  # noqa: F811


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
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES), type=Names(STAGES),
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
    # each stage ends by the sum of its budget and every earlier one's: a fast stage leaves its time to the next, and
    # the whole run ends within the sum of the budgets (BUDGET_S: 510 s) plus a job's grace to stop
    deadline = time.time()
    for stage in [s for s in STAGES if s in stages]:
        t0 = time.time()
        deadline += run.budgets[stage]
        run.log(f"stage {stage}: budget {run.budgets[stage]:.0f}s, {deadline - t0:.0f}s with what earlier stages left")
        try:
            body = STAGE_FUNCS[stage](run, deadline)
        except Exception as e:  # noqa: BLE001 - a stage that breaks is reported; the others still run
            import traceback

            body = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        body["meta"] = {**meta, "seconds": round(time.time() - t0, 1), "budget_s": run.budgets[stage],
                        "allowed_s": round(deadline - t0, 1)}
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
