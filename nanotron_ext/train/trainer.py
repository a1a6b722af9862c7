"""The training job: config -> process groups -> model, optimiser, data -> steps, validation,
checkpoints, metrics. `python -m nanotron_ext.train --config-file X.yaml` runs it under torchrun."""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist

from nanotron_ext.config.loader import config_to_dict, save_config
from nanotron_ext.config.schema import Config
from nanotron_ext.data.loader import build_train_loader, build_validation_loader
from nanotron_ext.errors import TrainingError
from nanotron_ext.fileio import write_text_atomic
from nanotron_ext.metrics.comm import total_sent_bytes
from nanotron_ext.metrics.flops import device_peak_tflops, flops_per_token, matmul_weights, mfu
from nanotron_ext.metrics.logger import MetricsLogger, plot_losses
from nanotron_ext.metrics.memory import peak_memory_bytes
from nanotron_ext.metrics.nvtx import enable_nvtx
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.context import context_for
from nanotron_ext.parallel.link import link_emulator_from_config
from nanotron_ext.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from nanotron_ext.train.guard import claim_folders, resume_advice
from nanotron_ext.train.replica import Replica, resume_hint, validation_summary


class Trainer:
    def __init__(self, cfg: Config, config_file: Optional[str] = None) -> None:
        self.cfg, self.config_file = cfg, config_file
        p = cfg.parallelism
        # bad layouts fail in context_for, before any process group exists
        self.ctx = context_for(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        self.is_main = dist.get_rank(self.ctx.world_pg) == 0
        self.run_dir = Path(cfg.general.output_dir) / cfg.general.run
        self._locks = self._claim_folders()
        enable_nvtx(cfg.logging.nvtx)

        dp_rank = dist.get_rank(self.ctx.dp_pg)
        # this rank's part of its DP replica: the model (built from the replica's config, self.model_cfg;
        # self.cfg stays the run's), optimiser, schedule, engine and DP sync, and the step they take
        self.replica = Replica(cfg, self.ctx, dp_rank, link=link_emulator_from_config(p.link))
        r = self.replica
        self.model_cfg, self.model, self.optimizer, self.scheduler = r.model_cfg, r.model, r.optimizer, r.scheduler
        self.engine, self.dp_sync = r.engine, r.dp_sync
        self.train_loader = build_train_loader(cfg, dp_rank=dp_rank, dp_size=p.dp, config_file=config_file)
        self.val_loader = build_validation_loader(cfg, dp_rank=dp_rank, dp_size=p.dp, config_file=config_file)
        note = self.train_loader.epoch_note(cfg.tokens.train_steps, cfg.tokens.batch_accumulation_per_replica)
        if note and self.is_main:
            print(note)
        self.ledger = get_ledger()

        self.step = 0
        ckpt = latest_checkpoint(cfg.checkpoints.dir) if cfg.checkpoints.resume == "auto" else None
        if ckpt is not None:
            try:
                extra = load_checkpoint(ckpt, self.ctx, model=self.model, optimizer=self.optimizer,
                                        scheduler=self.scheduler)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; {resume_advice(ckpt, config_to_dict(cfg))}") from None
            self.step = int(extra["step"])
            self.train_loader.load_state_dict(extra["loader"])
            self.dp_sync.load_state_dict(extra.get("dp_sync", {}))
            if self.is_main:
                print(f"resumed from {ckpt} at step {self.step}")
        # Written only once everything above succeeded and there is training left to do: a launch that
        # fails, or finds the run complete, leaves the run folder as it was.
        if self.is_main and self.step < cfg.tokens.train_steps:
            save_config(cfg, self.run_dir / "config.yaml")

        self.flops_token = flops_per_token(cfg.model, self.matmul_params(), cfg.tokens.sequence_length)
        self.peak_tflops = device_peak_tflops(cfg.logging.peak_tflops)
        self.tokens_per_step = p.dp * cfg.tokens.batch_accumulation_per_replica * cfg.tokens.micro_batch_size * cfg.tokens.sequence_length

    def _claim_folders(self) -> list:
        """Rank 0 locks the run and checkpoint folders for this process's life; every rank learns the verdict."""
        locks, error = [], None
        if self.is_main:
            try:
                locks = claim_folders(self.run_dir, Path(self.cfg.checkpoints.dir), self.cfg.checkpoints.resume)
            except TrainingError as e:
                error = str(e)
        box = [error]
        torch_dist.broadcast_object_list(box, src=0, group=self.ctx.world_pg)
        if box[0] is not None:
            raise TrainingError(box[0])
        return locks

    def matmul_params(self) -> int:
        """Matmul weights of the whole model (all stages, unsharded), embedding lookups excluded."""
        local = matmul_weights(self.model.named_parameters(), tied_head=self.cfg.model.tie_embeddings)
        total = torch.tensor([local], dtype=torch.float64, device=self.ctx.device)  # NCCL: CUDA tensors only
        if self.ctx.pp_pg.size() > 1:  # stages hold different layers; TP ranks already see full shapes
            dist.all_reduce(total, group=self.ctx.pp_pg)
        return int(total.item())

    def train_step(self) -> Dict[str, float]:
        micro = [next(self.train_loader) for _ in range(self.cfg.tokens.batch_accumulation_per_replica)]
        loss = self.replica.backward(micro)
        return self.replica.update(self.step + 1, loss.item())

    def validate(self) -> Dict[str, float]:
        batches = list(itertools.islice(self.val_loader, self.cfg.tokens.val_steps))
        return validation_summary([loss.item() for loss in self.replica.validation_losses(batches)])

    def save(self) -> Path:
        if self.replica.any_rank(not all(bool(torch.isfinite(q).all()) for q in self.model.parameters())):
            raise TrainingError(f"step {self.step}: the weights are not finite after the optimizer step; not saving "
                                f"them. {resume_hint(self.cfg)}; lower optimizer.lr")
        return save_checkpoint(
            self.cfg.checkpoints.dir, self.step, self.ctx, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, extra={"step": self.step, "loader": self.train_loader.state_dict(),
                                             "dp_sync": self.dp_sync.state_dict()},
            keep_last=self.cfg.checkpoints.keep_last, config=config_to_dict(self.cfg),
        )

    def train(self, stop_after: Optional[int] = None) -> Dict[str, object]:
        """Train to tokens.train_steps; `stop_after` ends early at that step (an interruption, for tests)."""
        cfg = self.cfg
        total = cfg.tokens.train_steps
        end = min(total, stop_after) if stop_after is not None else total
        if self.step >= end:  # nothing to train: report, and rewrite nothing in the run folder
            return self._report_complete() if self.step >= total else {}
        log = MetricsLogger(self.run_dir, cfg.logging, total, self.step, self.is_main)
        history: List[Dict[str, object]] = []
        val: Dict[str, float] = {}
        n_devices = self.ctx.world_pg.size()
        try:
            while self.step < end:
                self.ledger.reset()
                t0 = time.perf_counter()
                out = self.train_step()
                elapsed = time.perf_counter() - t0
                comm = total_sent_bytes(self.ledger, self.ctx.world_pg, self.ctx.device)  # this step's, all ranks
                self.step += 1
                tps = self.tokens_per_step / elapsed
                log.progress(1, loss=out["loss"], tok_s=tps, lr=out["lr"])  # before validation: its line follows
                record = {
                    "step": self.step, **out, "tokens_per_s": tps, "step_time_s": elapsed,
                    "peak_memory_bytes": peak_memory_bytes(), "comm_bytes": comm,
                }
                step_mfu = mfu(tps / n_devices, self.flops_token, self.peak_tflops)
                if step_mfu is not None:
                    record["mfu"] = step_mfu
                interval = cfg.tokens.val_check_interval
                if (interval and self.step % interval == 0) or self.step == total:
                    val = self.validate()
                    record.update(val)
                    log.write(f"step {self.step}: train loss {out['loss']:.4f}, validation loss {val['val_loss']:.4f} "
                              f"(ppl {val['val_ppl']:.1f})")
                if self.step % cfg.logging.log_interval == 0 or "val_loss" in record:
                    log.log(record)
                history.append(record)
                every = cfg.checkpoints.interval
                if (every and self.step % every == 0) or self.step == total:
                    self.save()
        finally:
            log.close()
        summary = self._summary(history, val)
        if self.is_main:
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            if log.path.exists():
                plot_losses(log.path, self.run_dir / "loss.png", title=cfg.general.run)
            print(format_summary(summary, self.run_dir))
        return summary

    def _report_complete(self) -> Dict[str, object]:
        path = self.run_dir / "summary.json"
        stored = json.loads(path.read_text()) if path.exists() else {}
        if self.is_main:
            print(f"run {self.run_dir} is complete (step {self.step} of {self.cfg.tokens.train_steps}, checkpoints in "
                  f"{self.cfg.checkpoints.dir}); nothing to do. Its stored results:" if stored else
                  f"run {self.run_dir} is complete (step {self.step}) but has no {path.name}; nothing to do")
            if stored:
                print(format_summary(stored, self.run_dir))
        return stored

    def _summary(self, history: List[Dict[str, object]], val: Dict[str, float]) -> Dict[str, object]:
        timed = history[1:] or history  # the first step pays one-off start-up costs
        comm: Dict[str, float] = {}
        for r in timed:
            for g, b in r["comm_bytes"].items():
                comm[g] = comm.get(g, 0) + b / len(timed)
        return {
            "steps": self.step,
            "final_train_loss": history[-1]["loss"] if history else None,
            "final_val_loss": val.get("val_loss"), "final_val_ppl": val.get("val_ppl"),
            "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
            "comm_bytes_per_step": {g: round(b) for g, b in comm.items()},
            "layout": {"dp": self.cfg.parallelism.dp, "tp": self.cfg.parallelism.tp, "pp": self.cfg.parallelism.pp},
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
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}  plot: {run_dir / 'loss.png'}")
    return "\n".join(lines)
