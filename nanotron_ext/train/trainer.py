"""The training job: config -> process groups -> model, optimiser, data -> steps, validation,
checkpoints, metrics. `python -m nanotron_ext.train --config-file X.yaml` runs it under torchrun."""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as torch_dist
from nanotron import distributed as dist

from nanotron_ext.config.loader import config_to_dict, save_config
from nanotron_ext.config.schema import Config
from nanotron_ext.data.loader import build_train_loader, build_validation_loader
from nanotron_ext.errors import TrainingError
from nanotron_ext.fileio import write_text_atomic
from nanotron_ext.metrics.logger import MetricsLogger, plot_losses, read_metrics
from nanotron_ext.metrics.nvtx import enable_nvtx
from nanotron_ext.metrics.step_meter import StepMeter, format_summary
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.context import context_for
from nanotron_ext.parallel.link import install_collective_links, link_emulator_from_config
from nanotron_ext.train.agreement import RankAgreement
from nanotron_ext.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from nanotron_ext.train.divergence import DivergenceGuard, weight_sq_norm
from nanotron_ext.train.failures import DISK_HINT
from nanotron_ext.train.guard import claim_folders, remove_other_checkpoints, resume_advice, resume_conflict
from nanotron_ext.train.handover import begin, complete, recover
from nanotron_ext.train.replica import Replica, validation_summary

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, config_file: Optional[str] = None) -> None:
        self.cfg, self.config_file = cfg, config_file
        p = cfg.parallelism
        # bad layouts fail in context_for, before any process group exists
        self.ctx = context_for(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        self.is_main = dist.get_rank(self.ctx.world_pg) == 0
        self.run_dir = Path(cfg.general.output_dir) / cfg.general.run
        # where this run's records go: the run folder, or (resume=overwrite, rank 0) a staging folder in it until
        # the first checkpoint hands the run folder over (train/handover.py)
        self.records_dir = self.run_dir
        self._locks = self._claim_folders()
        enable_nvtx(cfg.logging.nvtx)
        # the TP / DP tiers' collectives wait as their links would (pipeline links: in the model's P2P)
        self.link_tiers = install_collective_links(p.link, get_ledger().group_name)

        dp_rank = dist.get_rank(self.ctx.dp_pg)
        # this rank's part of its DP replica: the model (built from the replica's config, self.model_cfg;
        # self.cfg stays the run's), optimiser, schedule, engine and DP sync, and the step they take
        self.replica = Replica(cfg, self.ctx, dp_rank, link=link_emulator_from_config(p.link))
        r = self.replica
        self.model_cfg, self.model, self.optimizer, self.scheduler = r.model_cfg, r.model, r.optimizer, r.scheduler
        self.engine, self.dp_sync = r.engine, r.dp_sync
        shard, shards = self.dp_sync.data_shard(dp_rank, p.dp)
        self.train_loader = build_train_loader(cfg, dp_rank=shard, dp_size=shards, config_file=config_file)
        self.val_loader = build_validation_loader(cfg, dp_rank=shard, dp_size=shards, config_file=config_file)
        note = self.train_loader.epoch_note(cfg.tokens.train_steps, cfg.tokens.batch_accumulation_per_replica)
        if note and self.is_main:
            print(note)
        self.ledger = get_ledger()

        self.step = 0
        self._started = False
        self.guard = DivergenceGuard(cfg.general.max_loss_ratio, cfg.general.max_weight_growth)
        self._saved_here: List[Path] = []  # checkpoints this launch wrote
        # resume=overwrite: the earlier checkpoints are deleted once this run's first one is complete, not before
        self._overwrite_pending = cfg.checkpoints.resume == "overwrite"
        ckpt = latest_checkpoint(cfg.checkpoints.dir) if cfg.checkpoints.resume == "auto" else None
        if ckpt is not None:
            conflict = resume_conflict(ckpt, config_to_dict(cfg))  # every rank reads the same meta.json
            if conflict:
                raise CheckpointError(conflict)
            try:
                extra = load_checkpoint(ckpt, self.ctx, model=self.model, optimizer=self.optimizer,
                                        scheduler=self.scheduler)
                self._restore(ckpt, extra)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; {resume_advice(ckpt, config_to_dict(cfg))}") from None
            if self.is_main:
                print(f"resumed from {ckpt} at step {self.step}")
        # Written only once everything above succeeded and there is training left to do: a launch that
        # fails, or finds the run complete, leaves the run folder as it was.
        self.agree = RankAgreement(self.ctx.world_pg, self.ctx.device, self.ledger, self.is_main)
        self._weights_sq = weight_sq_norm(self.model.parameters())  # of the weights the next step starts from
        if self.step < cfg.tokens.train_steps:
            self.agree.on_main(lambda: save_config(cfg, self.records_dir / "config.yaml"))
        self.meter = StepMeter(cfg, self.ctx, self.model)

    def _restore(self, ckpt: Path, extra: Dict[str, object]) -> None:
        """The step, data position and outer-loop state from a loaded checkpoint; a state that does not fit fails
        on every rank with one CheckpointError (it used to be a traceback per rank)."""
        error = None
        try:
            self.step = int(extra["step"])
            self.train_loader.load_state_dict(extra["loader"])
            self.dp_sync.load_state_dict(extra.get("dp_sync", {}))
            self.guard.load_state_dict(extra.get("guard", {}))  # the run's first loss (older checkpoints: none)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{type(e).__name__}: {e}"
        errors: List[Optional[str]] = [None] * self.ctx.world_pg.size()
        torch_dist.all_gather_object(errors, error, group=self.ctx.world_pg)  # control, not training traffic
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise CheckpointError(f"the state saved in {ckpt} does not fit this run ({'; '.join(failed)[:500]})")

    def _claim_folders(self) -> list:
        """Rank 0 locks the run and checkpoint folders for this process's life; every rank learns the verdict."""
        locks, error = [], None
        if self.is_main:
            try:
                ckpt_dir = Path(self.cfg.checkpoints.dir)
                locks = claim_folders(self.run_dir, ckpt_dir, self.cfg.checkpoints.resume)
                note = recover(self.run_dir, ckpt_dir)  # before anything reads the checkpoints
                if note:
                    print(note, flush=True)
                if self.cfg.checkpoints.resume == "overwrite":
                    self.records_dir = begin(self.run_dir, ckpt_dir)
            except TrainingError as e:
                error = str(e)
            except OSError as e:  # a folder that cannot be created or written: every rank stops with the line
                error = f"{e}; {DISK_HINT}"
        box = [error]
        torch_dist.broadcast_object_list(box, src=0, group=self.ctx.world_pg)
        if box[0] is not None:
            raise TrainingError(box[0])
        return locks

    def train_step(self) -> Dict[str, float]:
        micro = [next(self.train_loader) for _ in range(self.cfg.tokens.batch_accumulation_per_replica)]
        loss = self.replica.backward(micro)
        out = self.replica.update(self.step + 1, loss.item(), judge=self._judge)
        self._weights_sq = weight_sq_norm(self.model.parameters())  # judged before saving and at the next step
        return out

    def _judge(self, loss_value: float, grad_norm: float) -> None:
        """Before optimiser step self.step + 1, on every rank together: stop on a non-finite loss or gradient
        norm, on weights the last step grew too much, or on a loss too far above the run's first."""
        stop, weights_sq = self.agree.control(not (math.isfinite(loss_value) and math.isfinite(grad_norm)),
                                              self._weights_sq)
        problem = (f"step {self.step + 1}: the loss is {loss_value} and the gradient norm {grad_norm} (not finite)"
                   if stop else self.guard.check_weights(self.step, weights_sq)
                   or self.guard.check_loss(self.step + 1, loss_value))
        if problem:  # the loss judged the weights of the last step, which a checkpoint may hold
            bad = self._set_aside_checkpoint(self.step)
            moved = f"; checkpoint {bad} holds the weights that gave this loss and was moved to {bad}.diverged" if bad else ""
            raise TrainingError(f"{problem}; stopped before the optimizer step, nothing was saved{moved}. "
                                f"{self._resume_hint(exclude=bad)}; lower optimizer.lr or check the model.* values")

    def _set_aside_checkpoint(self, step: int) -> Optional[Path]:
        """Move this launch's checkpoint of `step` (whose weights just gave a diverged loss) out of the resume
        namespace, kept as step_N.diverged; None when this launch did not write one."""
        bad = Path(self.cfg.checkpoints.dir) / f"step_{step}"
        if bad not in self._saved_here:
            return None
        if self.is_main:
            target = bad.with_name(f"{bad.name}.diverged")
            if target.exists():
                remove_checkpoint(target)
            os.replace(bad, target)
        return bad

    def last_checkpoint(self, exclude: Optional[Path] = None) -> Optional[Path]:
        """This run's newest complete checkpoint but `exclude` (with resume=overwrite the earlier run's, not yet
        deleted, do not count)."""
        if self._overwrite_pending:
            return None
        found = [p for _, p in list_checkpoints(self.cfg.checkpoints.dir) if p != exclude]
        return found[-1] if found else None

    def _resume_hint(self, exclude: Optional[Path] = None) -> str:
        last = self.last_checkpoint(exclude)
        return f"the last complete checkpoint is {last}" if last else f"there is no complete checkpoint in {self.cfg.checkpoints.dir}"

    def validate(self) -> Dict[str, float]:
        batches = list(itertools.islice(self.val_loader, self.cfg.tokens.val_steps))
        return validation_summary([loss.item() for loss in self.replica.validation_losses(batches)])

    def save(self) -> Path:
        stop, weights_sq = self.agree.control(not math.isfinite(float(self._weights_sq)), self._weights_sq)
        problem = (f"step {self.step}: the weights are not finite after the optimizer step" if stop
                   else self.guard.check_weights(self.step, weights_sq))
        if problem:
            raise TrainingError(f"{problem}; these weights were not saved. {self._resume_hint()}; lower optimizer.lr")
        path = save_checkpoint(
            self.cfg.checkpoints.dir, self.step, self.ctx, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, extra={"step": self.step, "loader": self.train_loader.state_dict(),
                                             "dp_sync": self.dp_sync.state_dict(), "guard": self.guard.state_dict()},
            keep_last=self.cfg.checkpoints.keep_last, config=config_to_dict(self.cfg),
        )
        self._saved_here.append(path)
        if self._overwrite_pending:  # this run has a complete checkpoint of its own now
            if self.is_main:
                remove_other_checkpoints(Path(self.cfg.checkpoints.dir), path)
            self._overwrite_pending = False
        if self.records_dir != self.run_dir:  # rank 0 of an overwrite: the records change owner with the checkpoints
            try:
                complete(self.run_dir, Path(self.cfg.checkpoints.dir))
                self.records_dir = self.run_dir
            except OSError as e:  # the next checkpoint, or the next launch, finishes it
                logger.warning("checkpoints.resume=overwrite: could not yet put this run's records in %s: %s",
                               self.run_dir, e)
        return path

    def train(self, stop_after: Optional[int] = None) -> Dict[str, object]:
        """Train to tokens.train_steps; `stop_after` ends early at that step (an interruption, for tests)."""
        cfg = self.cfg
        total = cfg.tokens.train_steps
        end = min(total, stop_after) if stop_after is not None else total
        if self.step >= end:  # nothing to train: report, and rewrite nothing in the run folder
            return self._report_complete() if self.step >= total else {}
        if not self._started:  # an outer loop whose replicas come and go joins them here, after the checkpoint
            self.dp_sync.start()
            self._started = True
        log = self.agree.on_main(lambda: MetricsLogger(self.records_dir, cfg.logging, total, self.step, True)) or \
            MetricsLogger(self.records_dir, cfg.logging, total, self.step, False)
        history: List[Dict[str, object]] = []
        val: Dict[str, float] = {}
        try:
            while self.step < end:
                self.meter.begin()
                out = self.train_step()
                self.step += 1
                record = self.meter.end(self.step, out)
                self.agree.main_io(log.progress, 1, loss=out["loss"], tok_s=record["tokens_per_s"], lr=out["lr"])
                interval = cfg.tokens.val_check_interval
                if (interval and self.step % interval == 0) or self.step == total:
                    val = self.validate()
                    record.update(val)
                    self.agree.main_io(log.write, f"step {self.step}: train loss {out['loss']:.4f}, validation loss "
                                             f"{val['val_loss']:.4f} (ppl {val['val_ppl']:.1f})")
                if self.step % cfg.logging.log_interval == 0 or "val_loss" in record:
                    self.agree.main_io(log.log, record)
                history.append(record)
                every = cfg.checkpoints.interval
                if (every and self.step % every == 0) or self.step == total:
                    self.save()
                    log.path = self.records_dir / log.path.name  # the open file moved with the handover
        finally:
            log.close()
        summary = self.meter.summary(history, val, self.step)
        if self.is_main:
            write_text_atomic(self.records_dir / "summary.json", json.dumps(summary, indent=2))
            if log.path.exists():
                plot_losses(log.path, self.records_dir / "loss.png", title=cfg.general.run)
            print(format_summary(summary, self.run_dir))
        return summary

    def _report_complete(self) -> Dict[str, object]:
        """A launch that finds the run complete: print its stored results and rewrite nothing. A run whose end
        failed (disk full writing summary.json, a kill after the final checkpoint) gets its summary (and loss plot)
        rebuilt from metrics.jsonl, at the step of the final checkpoint."""
        path, metrics = self.run_dir / "summary.json", self.run_dir / "metrics.jsonl"
        stored = json.loads(path.read_text()) if path.exists() else {}
        rebuilt = not stored
        if rebuilt:
            records = [r for r in read_metrics(metrics) if r["step"] <= self.step] if metrics.exists() else []
            val = next(({"val_loss": r["val_loss"], "val_ppl": r["val_ppl"]} for r in reversed(records)
                        if "val_loss" in r), {})
            stored = {**self.meter.summary(records, val, self.step),
                      "rebuilt": f"from {metrics.name} ({len(records)} logged steps) and the checkpoint of step {self.step}"}
        if self.is_main:
            if rebuilt:
                write_text_atomic(path, json.dumps(stored, indent=2))
                if metrics.exists() and not (self.run_dir / "loss.png").exists():
                    plot_losses(metrics, self.run_dir / "loss.png", title=self.cfg.general.run)
            print(f"run {self.run_dir} is complete (step {self.step} of {self.cfg.tokens.train_steps}, checkpoints in "
                  f"{self.cfg.checkpoints.dir}); nothing to do. " +
                  (f"Its {path.name} was missing and is rebuilt {stored['rebuilt']}:" if rebuilt else
                   "Its stored results:"))
            print(format_summary(stored, self.run_dir))
        return stored
