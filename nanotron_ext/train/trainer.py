"""The training job: config -> process groups -> model, optimiser, data -> steps, validation,
checkpoints, metrics. `python -m nanotron_ext.train --config-file X.yaml` runs it under torchrun."""
from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext

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
from nanotron_ext.train.agreement import RankAgreement, gather_or_raise
from nanotron_ext.train.checkpoint import CheckpointError
from nanotron_ext.train.divergence import DivergenceGuard, weight_sq_norm
from nanotron_ext.train.replica import Replica, validation_summary
from nanotron_ext.train.run_folder import RunFolder
from nanotron_ext.train.step_guard import DeviceGuard, Readback, guard_path


class Trainer:
    def __init__(self, cfg: Config, config_file: Optional[str] = None) -> None:
        self.cfg, self.config_file = cfg, config_file
        self.ctx, self.agree = self._context()  # bad layouts fail here, before any process group exists
        self.folder = RunFolder(cfg, self.agree)  # locked for this process's life
        self.replica = self._replica()
        self.train_loader, self.val_loader = self._loaders()
        self.guard = DivergenceGuard(cfg.general.max_loss_ratio, cfg.general.max_weight_growth)
        self.step = self.folder.start(self.ctx, self.replica, self._restore)  # 0, or the resumed checkpoint's
        self.meter = StepMeter(cfg, self.ctx, self.replica.model)
        self._weights_sq = weight_sq_norm(self.replica.model.parameters())  # of the weights the next step starts from
        on_device, self.guard_note = guard_path(cfg, self.replica.optimizer)
        self.device_guard = DeviceGuard(self.guard, self.agree, self.ctx.device) if on_device else None
        self._readback: Optional[Readback] = None  # the last step's guard values, on the device path
        self._started = False

    def _context(self) -> Tuple[ParallelContext, RankAgreement]:
        """The process groups of the configured layout, and what their ranks agree on (rank 0 writes the run's
        files; its failures reach every rank)."""
        ctx = context_for(self.cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        return ctx, RankAgreement(ctx.world_pg, ctx.device, get_ledger(), dist.get_rank(ctx.world_pg) == 0)

    def _replica(self) -> Replica:
        """This rank's part of its DP replica: the model (built from the replica's config, replica.model_cfg;
        self.cfg stays the run's), optimiser, schedule, engine and DP sync, and the step they take; NVTX ranges,
        and the emulated links of its collectives (TP / DP tiers) and of its pipeline (the model's P2P)."""
        link = self.cfg.parallelism.link
        enable_nvtx(self.cfg.logging.nvtx)
        install_collective_links(link, get_ledger().group_name)
        return Replica(self.cfg, self.ctx, dist.get_rank(self.ctx.dp_pg), link=link_emulator_from_config(link))

    def _loaders(self) -> Tuple[object, object]:
        """The train and validation loaders of this replica's data shard (the DP sync decides the sharding)."""
        cfg = self.cfg
        shard, shards = self.replica.dp_sync.data_shard(dist.get_rank(self.ctx.dp_pg), cfg.parallelism.dp)
        train = build_train_loader(cfg, dp_rank=shard, dp_size=shards, config_file=self.config_file)
        val = build_validation_loader(cfg, dp_rank=shard, dp_size=shards, config_file=self.config_file)
        note = train.epoch_note(cfg.tokens.train_steps, cfg.tokens.batch_accumulation_per_replica)
        if note and self.agree.is_main:
            print(note)
        return train, val

    def _state(self) -> Dict[str, object]:
        """What a checkpoint holds beside the replica's model, optimiser and schedule."""
        return {"step": self.step, "loader": self.train_loader.state_dict(),
                "dp_sync": self.replica.dp_sync.state_dict(), "guard": self.guard.state_dict()}

    def _restore(self, ckpt: Path, extra: Dict[str, object]) -> int:
        """The data position, outer-loop and guard state from a loaded checkpoint; its step. A state that does not
        fit fails on every rank with one CheckpointError (it used to be a traceback per rank)."""
        error, step = None, 0
        try:
            step = int(extra["step"])
            self.train_loader.load_state_dict(extra["loader"])
            self.replica.dp_sync.load_state_dict(extra.get("dp_sync", {}))
            self.guard.load_state_dict(extra.get("guard", {}))  # the run's first loss (older checkpoints: none)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{type(e).__name__}: {e}"
        def raise_as(failed: List[Tuple[int, str]]) -> CheckpointError:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)[:500]
            return CheckpointError(f"the state saved in {ckpt} does not fit this run ({detail})")
        gather_or_raise(error, self.ctx.world_pg, raise_as)
        return step

    def train_step(self) -> Dict[str, object]:
        """One step. On the device path (step_guard.py) its loss and grad_norm are device tensors, read by
        `_settle` a step later: nothing is read back between the forward and the optimizer step."""
        micro = [next(self.train_loader) for _ in range(self.cfg.tokens.batch_accumulation_per_replica)]
        loss = self.replica.backward(micro)
        if self.device_guard is None:
            out = self.replica.update(self.step + 1, loss.item(), judge=self._judge)
        else:
            out = self.replica.update(self.step + 1, loss, device_judge=self._judge_on_device)
        self._weights_sq = weight_sq_norm(self.replica.model.parameters())  # judged before saving and at the next step
        return out

    def _judge_on_device(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """`_judge` on the device: the verdict the optimizer skips on; its values are read by `_settle`."""
        verdict, values = self.device_guard.judge(loss, grad_norm, self._weights_sq)
        self._readback = Readback(values)
        return verdict

    def _settle(self, step: int, record: Dict[str, object], readback: Readback) -> None:
        """Read step `step`'s guard values (waiting for that step only) and judge them as the host path does, which
        raises naming the step; else the record gets its loss and gradient norm."""
        v = readback.read()
        if v.io_failed:
            self.agree.raise_shared(self.agree.io_error)
        self._stop_if(step, v.loss, v.grad_norm, bool(v.stop), v.weights_sq, refused=bool(v.refused))
        record["loss"], record["grad_norm"] = v.loss, v.grad_norm

    def _judge(self, loss_value: float, grad_norm: float) -> None:
        """Before optimiser step self.step + 1, on every rank together: stop on a non-finite loss or gradient
        norm, on weights the last step grew too much, or on a loss too far above the run's first."""
        stop, weights_sq = self.agree.control(not (math.isfinite(loss_value) and math.isfinite(grad_norm)),
                                              self._weights_sq)
        self._stop_if(self.step + 1, loss_value, grad_norm, stop, weights_sq)

    def _stop_if(self, step: int, loss_value: float, grad_norm: float, stop: bool, weights_sq: float,
                 refused: bool = False) -> None:
        """Raise if step `step` must not be taken (`refused`: the device guard skipped it)."""
        problem = (f"step {step}: the loss is {loss_value} and the gradient norm {grad_norm} (not finite)"
                   if stop else self.guard.check_weights(step - 1, weights_sq)
                   or self.guard.check_loss(step, loss_value))
        if refused and not problem:  # the device's comparisons are the host's, in float64: not expected
            problem = f"step {step}: the device guard refused the step (loss {loss_value}, gradient norm {grad_norm})"
        if problem:  # the loss judged the weights of the last step, which a checkpoint may hold
            # the weights are step - 1's: the host stopped before step `step`, or the device skipped it (and the
            # step queued after it, read a step late)
            self.step = step - 1
            bad = self.folder.set_aside(self.step)
            moved = (f"; checkpoint {bad} holds the weights that gave this loss and was moved to {bad}.diverged"
                     if bad else "")
            raise TrainingError(f"{problem}; stopped before the optimizer step, nothing was saved{moved}. "
                                f"{self.folder.resume_hint(exclude=bad)}; lower optimizer.lr or "
                                "check the model.* values")

    def validate(self) -> Dict[str, float]:
        batches = list(itertools.islice(self.val_loader, self.cfg.tokens.val_steps))
        return validation_summary([loss.item() for loss in self.replica.validation_losses(batches)])

    def save(self) -> Path:
        stop, weights_sq = self.agree.control(not math.isfinite(float(self._weights_sq)), self._weights_sq)
        problem = (f"step {self.step}: the weights are not finite after the optimizer step" if stop
                   else self.guard.check_weights(self.step, weights_sq))
        if problem:
            raise TrainingError(f"{problem}; these weights were not saved. "
                                f"{self.folder.resume_hint()}; lower optimizer.lr")
        return self.folder.save(self.step, self.ctx, self.replica, self._state())

    def train(self, stop_after: Optional[int] = None) -> Dict[str, object]:
        """Train to tokens.train_steps; `stop_after` ends early at that step (an interruption, for tests)."""
        cfg, folder = self.cfg, self.folder
        total = cfg.tokens.train_steps
        end = min(total, stop_after) if stop_after is not None else total
        if self.step >= end:  # nothing to train: report, and rewrite nothing in the run folder
            return self._report_complete() if self.step >= total else {}
        if not self._started:  # an outer loop whose replicas come and go joins them here, after the checkpoint
            self.replica.dp_sync.start()
            self._started = True
            if self.agree.is_main:
                print(self.guard_note, flush=True)
        log = self.agree.on_main(lambda: MetricsLogger(folder.records_dir, cfg.logging, total, self.step, True)) or \
            MetricsLogger(folder.records_dir, cfg.logging, total, self.step, False)
        history: List[Dict[str, object]] = []
        val: Dict[str, float] = {}
        try:
            waiting: Optional[Tuple[Dict[str, object], Readback]] = None  # the device path's last step, unread
            while self.step < end:
                self.meter.begin()
                out = self.train_step()
                self.step += 1
                record = self.meter.end(self.step, out)
                if waiting is not None:  # the step before, read now that this one is queued behind it
                    self._after_step(*waiting, log, history, val)
                    waiting = None
                if self._readback is not None and not self._read_at_once(self.step, end):
                    waiting = (record, self._readback)
                else:  # validation, a checkpoint and the end read the step at once: never after an unread verdict
                    self._after_step(record, self._readback, log, history, val)
                self._readback = None
        finally:
            log.close()
        summary = self.meter.summary(history, val, self.step)
        if self.agree.is_main:  # the plot first: summary.json marks the run complete (a kill between the two left
            if log.path.exists():  # no plot, and the relaunch found the run complete)
                plot_losses(log.path, folder.records_dir / "loss.png", title=cfg.general.run)
            write_text_atomic(folder.records_dir / "summary.json", json.dumps(summary, indent=2))
            print(format_summary(summary, folder.run_dir))
        return summary

    def _validates_at(self, step: int) -> bool:
        interval = self.cfg.tokens.val_check_interval
        return bool(interval) and step % interval == 0 or step == self.cfg.tokens.train_steps

    def _saves_at(self, step: int) -> bool:
        every = self.cfg.checkpoints.interval
        return bool(every) and step % every == 0 or step == self.cfg.tokens.train_steps

    def _read_at_once(self, step: int, end: int) -> bool:
        """Whether the device path reads step `step`'s verdict before the next step: the trainer validates or saves
        its weights, or it is the last of this call."""
        return self._validates_at(step) or self._saves_at(step) or step == end

    def _after_step(self, record: Dict[str, object], readback: Optional[Readback], log: MetricsLogger,
                    history: List[Dict[str, object]], val: Dict[str, float]) -> None:
        """Step record["step"]'s bookkeeping: its verdict read (device path), progress, validation (into `val`),
        the metrics record, a checkpoint."""
        cfg, step = self.cfg, int(record["step"])
        if readback is not None:
            self._settle(step, record, readback)
        self.agree.main_io(log.progress, 1, loss=record["loss"], tok_s=record["tokens_per_s"], lr=record["lr"])
        if self._validates_at(step):
            val.update(self.validate())
            record.update(val)
            self.agree.main_io(log.write, f"step {step}: train loss {record['loss']:.4f}, validation loss "
                                          f"{val['val_loss']:.4f} (ppl {val['val_ppl']:.1f})")
        if step % cfg.logging.log_interval == 0 or "val_loss" in record:
            self.agree.main_io(log.log, record)
        history.append(record)
        if self._saves_at(step):
            self.save()
            log.path = self.folder.records_dir / log.path.name  # the open file moved with the handover

    def _report_complete(self) -> Dict[str, object]:
        """A launch that finds the run complete: print its stored results and rewrite nothing. A run whose end
        failed (disk full writing summary.json, a kill after the final checkpoint) gets its summary rebuilt from
        metrics.jsonl, at the step of the final checkpoint (a damaged summary.json too), and a missing loss plot
        drawn again."""
        from nanotron_ext.cli_checks import JsonFile

        run_dir = self.folder.run_dir
        path, metrics = run_dir / "summary.json", run_dir / "metrics.jsonl"
        try:  # a damaged one (cut short by a full disk) is rebuilt like a missing one
            stored = JsonFile(path, "summary", TrainingError).read_object() if path.exists() else {}
        except TrainingError as e:
            if self.agree.is_main:
                print(f"{e}; it is rebuilt", flush=True)
            stored = {}
        rebuilt = not stored
        if rebuilt:
            records = [r for r in read_metrics(metrics) if r["step"] <= self.step] if metrics.exists() else []
            val = next(({"val_loss": r["val_loss"], "val_ppl": r["val_ppl"]} for r in reversed(records)
                        if "val_loss" in r), {})
            stored = {**self.meter.summary(records, val, self.step),
                      "rebuilt": f"from {metrics.name} ({len(records)} logged steps) and the checkpoint "
                                 f"of step {self.step}"}
        if self.agree.is_main:
            plot = run_dir / "loss.png"
            missing_plot = metrics.exists() and not plot.exists()
            if missing_plot:  # a kill after summary.json (written after the plot since, before it once)
                plot_losses(metrics, plot, title=self.cfg.general.run)
            if rebuilt:
                write_text_atomic(path, json.dumps(stored, indent=2))
            elif missing_plot:
                print(f"{plot} was missing and is drawn again from {metrics.name}", flush=True)
            print(f"run {run_dir} is complete (step {self.step} of {self.cfg.tokens.train_steps}, checkpoints in "
                  f"{self.cfg.checkpoints.dir}); nothing to do. " +
                  (f"Its {path.name} was missing and is rebuilt {stored['rebuilt']}:" if rebuilt else
                   "Its stored results:"))
            print(format_summary(stored, run_dir))
        return stored
