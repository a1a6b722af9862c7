"""Worker side of benchmarks/gpu_check.py: one job runs a list of items in this process under torchrun
(world size 1: NCCL on a GPU, gloo on CPU) and appends each item's row to a JSONL file as it finishes, so
a job that dies or runs out of time keeps what it measured.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_check_jobs.py \
        --job techniques --plan plan.json --results rows.jsonl [--skip a,b]

Jobs (the plan, written by gpu_check.py, says what each item is):
    techniques  train one config for N steps through the real Trainer (or sparseloco.simulate.run_simulated):
                per-step losses, ledger bytes per step, bytes of every codec wire per step, SparseLoCo
                payload bytes, peak memory, and every parameter, buffer and optimiser state not on ctx.device
    throughput  examples/config_125m_gpu.yaml: nanotron_ext's training iteration vs the plain-PyTorch loop
                (benchmarks/plain_llama.py) started from the same weights, interleaved; tokens/s, MFU, memory
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
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plain_llama beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (nanotron_ext, reproduce)

_CONTEXTS: List[Any] = []  # the one ParallelContext of the throughput and codecs jobs


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


def shared_context(cfg: Any) -> Any:
    """One ParallelContext for the jobs that build models themselves (throughput, codecs)."""
    from nanotron_ext.bench.launch import init_distributed

    if not _CONTEXTS:
        _CONTEXTS.append(init_distributed(cfg))
    return _CONTEXTS[0]


def load(plan: Dict[str, Any], overrides: List[str]) -> Any:
    from nanotron_ext.config.loader import load_config

    return load_config(plan["config_file"], list(plan["overrides"]) + list(overrides))


# ------------------------------------------------------------------------------------------------
# techniques: the real trainer (or the simulated SparseLoCo replicas) for a few steps
# ------------------------------------------------------------------------------------------------
def run_technique(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    name = item["name"]
    cfg = load(plan, item["overrides"] + [f"general.run={name}", f"checkpoints.dir={plan['checkpoints']}/{name}"])
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.general.backend == "nccl" else torch.device("cpu")
    reset_peak(device)
    # the arithmetic that sets the CUDA-vs-CPU tolerance: bf16 autocast, or bf16 inside an optimizer
    row: Dict[str, Any] = {"dtype": item.get("precision", cfg.model.dtype), "device": str(device)}
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
        wires = WireCounter(trainer.model)
        summary = trainer.train()
        records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "loss" in r]
        row.update(losses=[r["loss"] for r in records], val_loss=summary.get("final_val_loss"),
                   comm_bytes=[r["comm_bytes"] for r in records],
                   wire_bytes_per_step=wires.bytes // max(1, len(records)),
                   mfu=records[-1].get("mfu"), tokens_per_s=summary.get("tokens_per_s"),
                   misplaced=misplaced([trainer.model], trainer.optimizer, trainer.ctx.device),
                   checkpoint_saved=latest_checkpoint(cfg.checkpoints.dir) is not None)
        if trainer.ctx.device != device:
            row["misplaced"].insert(0, f"ctx.device is {trainer.ctx.device}, expected {device}")
        del trainer
    row["peak_memory_bytes"] = peak_bytes(device)
    return row


# ------------------------------------------------------------------------------------------------
# throughput: nanotron_ext vs the plain-PyTorch loop, same shape, same weights, interleaved
# ------------------------------------------------------------------------------------------------
def _sdpa(flash: bool) -> contextlib.AbstractContextManager:
    if not flash:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def run_throughput(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    import plain_llama as pl

    from nanotron_ext.bench import timing as bt
    from nanotron_ext.bench import workload as bw
    from nanotron_ext.metrics.flops import device_peak_tflops, flops_per_token, matmul_weights, mfu
    from nanotron_ext.train.pipeline_step import evaluate

    cfg = load(plan, ["model.compile=true"] if item["compile"] else [])
    ctx = shared_context(cfg)
    device, bf16 = ctx.device, cfg.model.dtype == "bf16"
    ours = bw.build_trainee(cfg, ctx)
    plain = pl.PlainLlama(cfg.model).to(device)
    plain.load_from(ours.model)
    plain_opt = pl.make_optimizer(plain, cfg.optimizer)
    if item["compile"]:
        plain.compile_blocks()
    batches = [{k: v.to(device) for k, v in mb.items()}
               for mb in bw.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica)]
    tokens = cfg.tokens.batch_accumulation_per_replica * cfg.tokens.micro_batch_size * cfg.tokens.sequence_length
    seq = cfg.tokens.sequence_length
    flops = {"nanotron_ext": flops_per_token(cfg.model, matmul_weights(ours.model.named_parameters(),
                                                                       cfg.model.tie_embeddings), seq),
             "plain": flops_per_token(cfg.model, sum(p.numel() for n, p in plain.named_parameters()  # lookup: no matmul
                                                     if p.ndim == 2 and (n != "embed.weight" or plain.tied)), seq)}
    peak = device_peak_tflops(cfg.logging.peak_tflops) if device.type == "cuda" else None
    steps = {"nanotron_ext": lambda: bw.train_iteration(ours, ctx, batches),
             "plain": lambda: pl.train_step(plain, plain_opt, batches, cfg.optimizer.clip_grad, bf16)}
    row: Dict[str, Any] = {"compile": item["compile"], "flash": item["flash"], "tokens_per_iteration": tokens,
                           "flops_per_token": flops, "peak_tflops": peak, "models": {}}
    with _sdpa(item["flash"]):
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
    row["ratio"] = row["models"]["nanotron_ext"]["tokens_per_s"] / row["models"]["plain"]["tokens_per_s"]
    return row  # the models go with this frame; the job loop releases the cache


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
    "techniques": run_technique, "throughput": run_throughput, "codecs": run_codec}


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


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), required=True)
    p.add_argument("--plan", required=True, help="the plan JSON gpu_check.py wrote")
    p.add_argument("--results", required=True, help="JSONL file the rows are appended to")
    p.add_argument("--skip", default="", help="comma-separated item names already done")
    args = p.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
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
