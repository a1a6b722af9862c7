"""Worker side of benchmarks/gpu_check.py: one job runs a list of items in this process under torchrun
(world size 1: NCCL on a GPU, gloo on CPU) and appends each item's row to a JSONL file as it finishes, so
a job that dies or runs out of time keeps what it measured.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_check_jobs.py \
        --job techniques --plan plan.json --results rows.jsonl [--skip a,b]

Jobs (the plan, written by gpu_check.py, says what each item is):
    techniques  train one config for N steps through the real Trainer (or sparseloco.simulate.run_simulated):
                per-step losses, ledger bytes per step, bytes of every codec wire per step, SparseLoCo
                payload bytes, peak memory, and every parameter, buffer and optimiser state not on ctx.device
    throughput  the plan's config (the 125M example, or the 1B row): nanotron_ext's training step as the trainer
                takes it vs the plain-PyTorch loop (benchmarks/plain_llama.py) started from the same weights
                (gpu_check_pair.py), interleaved; tokens/s, MFU, memory, which step-guard path ours ran
    profile     the same pair under torch.profiler: top kernels and device time per kind of work
    memory      each config alone through the trainer's step: the allocator's peak, eager and compiled
                (gpu_check_memory.py, which the planner's figures are compared with)
    codecs      each boundary codec alone at the throughput shape: encode, decode, encode+decode fwd+bwd
                time per token and wire bytes per token
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plain_llama beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (nanotron_ext, reproduce)

from gpu_check_memory import run_memory  # noqa: E402
from gpu_check_pair import attention, build_pair, shared_context  # noqa: E402

from nanotron_ext.cli_flags import one_line_refusals  # noqa: E402


# ------------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------------
def misplaced(modules: Iterable[torch.nn.Module], optimizer: Any, device: torch.device) -> List[str]:
    """Parameters, buffers and optimiser state that are not on `device` (torch keeps AdamW's scalar
    `step` on the CPU by design: 0-d state is not counted)."""
    bad = []
    for m in modules:
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.device != device:
                bad.append(f"{name}@{t.device}")
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.ndim > 0 and v.device != device:
                    bad.append(f"optimizer state {key}@{v.device}")
    return sorted(set(bad))[:20]


class WireCounter:
    """Bytes of every codec wire a decoder layer emits in training forwards (validation excluded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.bytes = 0
        self.handles = []
        for block in getattr(model, "decoder", []):
            layer = getattr(block, "pp_block", None)
            if layer is not None and getattr(layer, "boundary_encoder", None) is not None:
                self.handles.append(layer.register_forward_hook(self._hook))

    def _hook(self, module: torch.nn.Module, args: Any, output: Dict[str, torch.Tensor]) -> None:
        if torch.is_grad_enabled() and "wire" in output:
            self.bytes += output["wire"].numel() * output["wire"].element_size()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> Optional[int]:
    """CUDA allocator peak since reset_peak; None on CPU (process RSS does not separate the items)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(plan: Dict[str, Any], overrides: List[str]) -> Any:
    from nanotron_ext.config.loader import load_config

    return load_config(plan["config_file"], list(plan["overrides"]) + list(overrides))


# ------------------------------------------------------------------------------------------------
# techniques: the real trainer (or the simulated SparseLoCo replicas) for a few steps
# ------------------------------------------------------------------------------------------------
CHECK_KEYS = ("first_tolerance", "tolerance", "max_code_disagreement")  # gpu_check.DISCRETE_CHECKS


@contextlib.contextmanager
def code_tape(tape: Optional[Dict[str, str]], row: Dict[str, Any]) -> Iterator[None]:
    """{"record": path}: save every RVQ code assignment of the run there; {"replay": path}: force those assignments
    and put the fraction this run's own argmin would have changed in row["code_disagreement"]; None: nothing."""
    if not tape:
        yield
        return
    from nanotron_ext.mapl.rvq import CodeTape

    path = Path(tape.get("record") or tape["replay"])
    on = CodeTape() if "record" in tape else CodeTape(torch.load(path, weights_only=True)["codes"])
    with on:
        yield
    if "record" in tape:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(on.state(), path)
        row["tape"] = str(path)
    else:
        row["code_disagreement"] = on.disagreement()


# ------------------------------------------------------------------------------------------------
# the technique runs
# ------------------------------------------------------------------------------------------------
def run_technique(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    name = item["name"]
    cfg = load(plan, item["overrides"] + [f"general.run={name}", f"checkpoints.dir={plan['checkpoints']}/{name}"])
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.general.backend == "nccl" else torch.device("cpu")
    reset_peak(device)
    # the arithmetic that sets the CUDA-vs-CPU tolerance: bf16 autocast, or bf16 inside an optimizer
    row: Dict[str, Any] = {"dtype": item.get("precision", cfg.model.dtype), "device": str(device),
                           "check": {k: item[k] for k in CHECK_KEYS if k in item}}
    if item.get("replicas"):
        from nanotron_ext.sparseloco.simulate import run_simulated

        out = run_simulated(cfg, item["replicas"], "sparseloco", plan["config_file"])
        row.update(losses=out["train_loss"], val_loss=out["val_loss"], sync_bytes=out["sync_bytes"],
                   misplaced=misplaced(out["models"], None, device))
        del out
    else:
        from nanotron_ext.train.checkpoint import latest_checkpoint
        from nanotron_ext.train.trainer import Trainer

        trainer = Trainer(cfg, config_file=plan["config_file"])
        wires = WireCounter(trainer.replica.model)
        with code_tape(item.get("tape"), row):
            summary = trainer.train()
        records = [r for r in read_metrics(trainer.folder.run_dir / "metrics.jsonl") if "loss" in r]
        row.update(losses=[r["loss"] for r in records], val_loss=summary.get("final_val_loss"),
                   comm_bytes=[r["comm_bytes"] for r in records],
                   wire_bytes_per_step=wires.bytes // max(1, len(records)),
                   mfu=records[-1].get("mfu"), tokens_per_s=summary.get("tokens_per_s"),
                   misplaced=misplaced([trainer.replica.model], trainer.replica.optimizer, trainer.ctx.device),
                   checkpoint_saved=latest_checkpoint(cfg.checkpoints.dir) is not None)
        if trainer.ctx.device != device:
            row["misplaced"].insert(0, f"ctx.device is {trainer.ctx.device}, expected {device}")
        del trainer
    row["peak_memory_bytes"] = peak_bytes(device)
    return row


# ------------------------------------------------------------------------------------------------
# throughput: nanotron_ext vs the plain-PyTorch loop, same shape, same weights, interleaved
# ------------------------------------------------------------------------------------------------
def run_throughput(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    import plain_llama as pl

    from nanotron_ext.bench import timing as bt
    from nanotron_ext.bench import workload as bw
    from nanotron_ext.metrics.flops import device_peak_tflops, flops_per_token, matmul_weights, mfu
    from nanotron_ext.train.pipeline_step import evaluate

    pair = build_pair(item, plan)
    cfg, ctx, ours, plain, batches, steps = (pair[k] for k in ("cfg", "ctx", "ours", "plain", "batches", "steps"))
    device, bf16 = ctx.device, cfg.model.dtype == "bf16"
    tokens = cfg.tokens.batch_accumulation_per_replica * cfg.tokens.micro_batch_size * cfg.tokens.sequence_length
    seq = cfg.tokens.sequence_length
    flops = {"nanotron_ext": flops_per_token(cfg.model, matmul_weights(ours.model.named_parameters(),
                                                                       cfg.model.tie_embeddings), seq),
             "plain": flops_per_token(cfg.model, sum(p.numel() for n, p in plain.named_parameters()  # lookup: no matmul
                                                     if p.ndim == 2 and (n != "embed.weight" or plain.tied)), seq)}
    peak = device_peak_tflops(cfg.logging.peak_tflops) if device.type == "cuda" else None
    row: Dict[str, Any] = {"compile": item["compile"], "attention": item["attention"], "tokens_per_iteration": tokens,
                           "flops_per_token": flops, "peak_tflops": peak,
                           "optimizers": pair["optimizers"], "step_guard": pair["step_guard"], "models": {}}
    with attention(item["attention"]):
        with bw.autocast_for(cfg, device):  # same weights, same batch: the same function before any step
            row["first_loss"] = {"nanotron_ext": evaluate(ours.model, ours.engine, batches, ctx).item()}
        row["first_loss"]["plain"] = pl.eval_loss(plain, batches, bf16)
        timings = bt.interleaved(steps, device, plan["iters"])
        for name, fn in steps.items():
            reset_peak(device)
            fn()
            s = bt.summarize(timings[name].wall, plan["warmup"])
            tps = tokens / s.median
            row["models"][name] = {"tokens_per_s": tps, "median_s": s.median, "std_s": s.std, "n": s.n,
                                   "first_iteration_s": timings[name].wall[0], "mfu": mfu(tps, flops[name], peak),
                                   "peak_memory_bytes": peak_bytes(device)}
        ours.finish()  # the last step's verdict: a refused step would make this row time something else
    row["ratio"] = row["models"]["nanotron_ext"]["tokens_per_s"] / row["models"]["plain"]["tokens_per_s"]
    return row  # the models go with this frame; the job loop releases the cache


# ------------------------------------------------------------------------------------------------
# profile: where one training iteration's device time goes, ours and plain
# ------------------------------------------------------------------------------------------------
KINDS = (  # (kind, substrings of a kernel or op name, lower case); the first match wins
    ("communication", ("nccl", "allreduce", "all_reduce", "c10d::")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("optimizer and clipping", ("adam", "multi_tensor_apply", "foreach", "optimizer.step", "lpnorm", "normtwoops",
                                "vector_norm")),
    ("loss", ("softmax", "cross_entropy", "nll_loss", "logsumexp")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "aten::mm", "aten::bmm", "aten::addmm", "aten::linear")),
    ("fused elementwise (compiled)", ("triton_",)),
    ("copies and casts", ("copy", "memcpy", "memset", "_to_copy", "cat")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def _self_time_us(ev: Any, cuda: bool) -> float:
    if not cuda:
        return float(ev.self_cpu_time_total)
    return float(getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0))


def profile_table(prof: Any, cuda: bool, iters: int, top: int) -> Dict[str, Any]:
    """Top kernels (device events on a GPU; CPU ops in the dry run) by self time per iteration, and that time summed
    per kind (KINDS). Device events are the kernels themselves, so the kinds add up to the device's busy time."""
    from torch.autograd import DeviceType

    events = [ev for ev in prof.key_averages()
              if not cuda or getattr(ev, "device_type", None) == DeviceType.CUDA]
    rows = sorted(({"name": ev.key, "calls": ev.count // iters, "ms": _self_time_us(ev, cuda) / 1e3 / iters,
                    "kind": kind_of(ev.key)} for ev in events if _self_time_us(ev, cuda) > 0),
                  key=lambda r: -r["ms"])
    kinds: Dict[str, float] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0.0) + r["ms"]
    return {"top": rows[:top], "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "busy_ms": sum(r["ms"] for r in rows), "clock": "device" if cuda else "cpu"}


def run_profile(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from nanotron_ext.bench import timing as bt

    pair = build_pair(item, plan)
    device, steps, iters = pair["ctx"].device, pair["steps"], plan["profile_iters"]
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    row: Dict[str, Any] = {"setting": item["name"], "iterations": iters, "optimizers": pair["optimizers"],
                           "step_guard": pair["step_guard"], "models": {}}
    with attention(item["attention"]):
        for name, fn in steps.items():
            for _ in range(plan["warmup"] + 1):  # compile and warm up outside the profile
                fn()
            wall = bt.summarize(bt.timed(fn, device, iters).wall, 0).median
            with profile(activities=activities) as prof:
                for _ in range(iters):
                    fn()
                if cuda:
                    torch.cuda.synchronize(device)
            row["models"][name] = {"wall_ms": wall * 1e3, **profile_table(prof, cuda, iters, plan["top"])}
        pair["ours"].finish()  # the last step's verdict, as in the throughput rows
    return row


# ------------------------------------------------------------------------------------------------
# codecs: one boundary's encoder and decoder alone
# ------------------------------------------------------------------------------------------------
def run_codec(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    from nanotron_ext.bench import timing as bt
    from nanotron_ext.bench import workload as bw

    cfg = load(plan, item["overrides"] + ["model.num_layers=2", "model.codec.boundaries=[0]"])
    ctx = shared_context(cfg)
    device = ctx.device
    model = bw.build_trainee(cfg, ctx, with_optimizer=False).model
    enc, dec = model.codec_encoders[0], model.codec_decoders[0]
    mb, s, d = cfg.tokens.micro_batch_size, cfg.tokens.sequence_length, cfg.model.hidden_size
    g = torch.Generator().manual_seed(cfg.general.seed)
    x, branch = (torch.randn(mb, s, d, generator=g).to(device) for _ in range(2))
    ids = torch.randint(0, cfg.model.vocab_size, (mb, s), generator=g).to(device)
    tokens = mb * s

    def roundtrip() -> None:
        xr, br = x.detach().requires_grad_(True), branch.detach().requires_grad_(True)
        residual, hidden = dec(enc(residual=xr, branch=br, input_ids=ids), ids)
        (residual.float().sum() + hidden.float().sum()).backward()

    def median_ns(fn: Callable[[], Any]) -> float:
        return bt.summarize(bt.timed(fn, device, plan["iters"]).wall, plan["warmup"]).median * 1e9 / tokens

    with bw.autocast_for(cfg, device):
        with torch.no_grad():
            wire = enc(residual=x, branch=branch, input_ids=ids)
            encode = median_ns(lambda: enc(residual=x, branch=branch, input_ids=ids))
            decode = median_ns(lambda: dec(wire, ids))
        both = median_ns(roundtrip)
    wire_bytes = wire.numel() * wire.element_size() / tokens + (4 if model.codec.needs_token_ids else 0)
    row = {"encode_ns_per_token": encode, "decode_ns_per_token": decode, "fwd_bwd_ns_per_token": both,
           "wire_bytes_per_token": wire_bytes, "wire_dtype": str(wire.dtype).replace("torch.", ""),
           "hidden_bytes_per_token": d * 4, "tokens": tokens, "misplaced": misplaced([model], None, device)}
    return row  # the models go with this frame; the job loop releases the cache


JOBS: Dict[str, Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]] = {
    "techniques": run_technique, "throughput": run_throughput, "codecs": run_codec, "profile": run_profile,
    "memory": run_memory}


# ------------------------------------------------------------------------------------------------
# the job loop
# ------------------------------------------------------------------------------------------------
def _append(path: Path, row: Dict[str, Any]) -> None:
    with open(path, "a") as f:  # one line per event: a crash leaves every earlier line whole
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fatal(e: BaseException) -> bool:
    """An error after which this process must not go on (the CUDA context or NCCL may be broken)."""
    text = f"{type(e).__name__}: {e}"
    return any(k in text for k in ("CUDA error", "NCCL", "cuDNN error", "CUBLAS_STATUS", "illegal memory"))


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_checks import ArgumentError, JsonFile, refuse
    from nanotron_ext.cli_flags import InputFile, Parser, Text

    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), required=True)
    p.add_argument("--plan", required=True, type=InputFile(format="json"), help="the plan JSON gpu_check.py wrote")
    p.add_argument("--results", required=True, help="JSONL file the rows are appended to")
    p.add_argument("--skip", default="", type=Text(empty=True), help="comma-separated item names already done")
    args = p.parse_args(argv)
    given = JsonFile(Path(args.plan), "--plan", advice="give the plan gpu_check.py wrote")
    try:
        plan = given.read_object()
        given.need(plan, "items", list)
        given.number(plan, "deadline")
    except ArgumentError as e:
        refuse(e)
    if plan.get("compile_backend"):
        # the dry run: inductor's code generation takes ~30 s per graph on 2 CPU cores; tracing and AOT
        # autograd (what breaks when the model cannot be compiled) still run with this backend
        torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend=plan["compile_backend"])
    skip = set(filter(None, args.skip.split(",")))
    results = Path(args.results)
    for item in plan["items"]:
        name = item["name"]
        if name in skip:
            continue
        if time.time() > plan["deadline"]:
            _append(results, {"name": name, "status": "skipped", "note": "the stage's time budget was spent"})
            continue
        _append(results, {"name": name, "status": "started"})
        t0 = time.perf_counter()
        try:
            row = {"name": name, "status": "ok", **JOBS[args.job](item, plan)}
        except Exception as e:  # noqa: BLE001 - one item's failure is a result; the job goes on
            row = {"name": name, "status": "failed", "error": f"{type(e).__name__}: {e}"[:500],
                   "traceback": traceback.format_exc()[-3000:]}
            if _fatal(e):
                row["seconds"] = time.perf_counter() - t0
                _append(results, row)
                return 3  # the orchestrator starts a fresh process for the remaining items
        row["seconds"] = time.perf_counter() - t0
        _append(results, row)
        release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
