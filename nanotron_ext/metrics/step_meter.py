"""What each training step measured, and the run's summary of it.

    meter.begin()                    # the comm ledger reset, the links' wait clocks and the step clock read
    ...                              # the step
    record = meter.end(step, out)    # collective: the metrics.jsonl record of `step` (`out`: loss, grad_norm, lr;
                                     # the trainer's device guard gives device tensors, replaced by floats a step later)
    summary = meter.summary(history, val, step)

A record holds the step's time, tokens/s, peak memory, the bytes every rank sent per group, with emulated links
the fraction of the step each tier waited on them and each rank's CPU seconds, and MFU where the device's peak is known.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from nanotron import distributed as dist

from nanotron_ext.config.schema import Config
from nanotron_ext.metrics.comm import link_wait_fractions, total_sent_bytes
from nanotron_ext.metrics.flops import device_peak_tflops, flops_per_token, matmul_weights, mfu
from nanotron_ext.metrics.memory import peak_memory_bytes
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.link import waited_seconds


def matmul_params(model: torch.nn.Module, tied_head: bool, ctx: Any) -> int:
    """Matmul weights of the whole model (all stages, unsharded), embedding lookups excluded."""
    local = matmul_weights(model.named_parameters(), tied_head=tied_head)
    total = torch.tensor([local], dtype=torch.float64, device=ctx.device)  # NCCL: CUDA tensors only
    if ctx.pp_pg.size() > 1:  # stages hold different layers; TP ranks already see full shapes
        dist.all_reduce(total, group=ctx.pp_pg)
    return int(total.item())


class StepMeter:
    def __init__(self, cfg: Config, ctx: Any, model: torch.nn.Module) -> None:
        """Collective (the model's matmul weights are summed over the pipeline stages)."""
        self.cfg, self.ctx = cfg, ctx
        self.ledger = get_ledger()
        self.flops_token = flops_per_token(cfg.model, matmul_params(model, cfg.model.tie_embeddings, ctx),
                                           cfg.tokens.sequence_length)
        self.peak_tflops = device_peak_tflops(cfg.logging.peak_tflops)
        t = cfg.tokens
        self.tokens_per_step = (cfg.parallelism.dp * t.batch_accumulation_per_replica * t.micro_batch_size
                                * t.sequence_length)
        self._waited0: Dict[str, float] = {}
        self._t0 = self._cpu0 = 0.0

    def begin(self) -> None:
        self.ledger.reset()
        self._waited0 = waited_seconds()
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()

    def end(self, step: int, out: Dict[str, float]) -> Dict[str, Any]:
        """The record of `step`, which began at `begin` (collective: bytes and link waits are summed over ranks)."""
        elapsed = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        comm = total_sent_bytes(self.ledger, self.ctx.world_pg, self.ctx.device)  # this step's, all ranks
        waited = {t: s - self._waited0.get(t, 0.0) for t, s in waited_seconds().items()}
        tps = self.tokens_per_step / elapsed
        record = {
            "step": step, **out, "tokens_per_s": tps, "step_time_s": elapsed,
            "peak_memory_bytes": peak_memory_bytes(), "comm_bytes": comm,
        }
        if self.cfg.parallelism.link.enabled:  # where the step's time went: waiting on each tier's links
            record["link_wait_fraction"], record["rank_cpu_s"] = link_wait_fractions(
                waited, elapsed, cpu, self.ctx.world_pg, self.ctx.device)
        elif self.cfg.logging.rank_cpu_seconds:  # real links: only the compute the clock prices the step with
            record["rank_cpu_s"] = link_wait_fractions(waited, elapsed, cpu, self.ctx.world_pg, self.ctx.device)[1]
        step_mfu = mfu(tps / self.ctx.world_pg.size(), self.flops_token, self.peak_tflops)
        if step_mfu is not None:
            record["mfu"] = step_mfu
        return record

    def summary(self, history: List[Dict[str, Any]], val: Dict[str, float], steps: int) -> Dict[str, object]:
        """The run at step `steps`: the last loss, validation, and the means over `history` (the records) but its
        first step, which pays one-off start-up costs."""
        timed = history[1:] or history
        comm: Dict[str, float] = {}
        for r in timed:
            for g, b in r["comm_bytes"].items():
                comm[g] = comm.get(g, 0) + b / len(timed)
        waits = [r["link_wait_fraction"] for r in timed if "link_wait_fraction" in r]
        cpus = [r["rank_cpu_s"] for r in timed if "rank_cpu_s" in r]
        p = self.cfg.parallelism
        return {
            "steps": steps,
            "final_train_loss": history[-1]["loss"] if history and history[-1]["step"] == steps else None,
            "final_val_loss": val.get("val_loss"), "final_val_ppl": val.get("val_ppl"),
            "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
            "comm_bytes_per_step": {g: round(b) for g, b in comm.items()},
            **({"link_wait_fraction": {t: sum(w[t] for w in waits) / len(waits) for t in waits[0]}} if waits else {}),
            **({"rank_cpu_step_s": [round(sum(c) / len(cpus), 6) for c in zip(*cpus)]} if cpus else {}),
            "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp},
        }


def format_summary(summary: Dict[str, object], run_dir: Path) -> str:
    def mib(b: float) -> str:
        return f"{b / 2**20:.3f} MiB"

    lines = ["", f"== summary: {run_dir} ==", f"steps                 {summary['steps']}"]
    if summary["final_train_loss"] is not None:
        lines.append(f"final train loss      {summary['final_train_loss']:.4f}")
    if summary["final_val_loss"] is not None:
        lines.append(f"final validation loss {summary['final_val_loss']:.4f} (ppl {summary['final_val_ppl']:.1f})")
    if summary["tokens_per_s"] is not None:
        lines.append(f"tokens/s              {summary['tokens_per_s']:.0f}")
    lines.append("bytes sent per step (all ranks):")
    for g, b in sorted(summary["comm_bytes_per_step"].items()):
        lines.append(f"  {g:<6} {mib(b)}")
    if "link_wait_fraction" in summary:
        waits = ", ".join(f"{t} {f:.1%}" for t, f in summary["link_wait_fraction"].items())
        lines.append(f"step time waiting on emulated links (mean over ranks): {waits}")
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}  plot: {run_dir / 'loss.png'}")
    return "\n".join(lines)
