"""One data-parallel replica's training step and validation: the Trainer runs one per rank, the simulated
SparseLoCo runner (nanotron_ext.sparseloco.simulate.run_simulated) runs M of them in one process, so both
take the same step (micro-batches, autocast, forward/backward, clipping, the non-finite guard, the
optimiser, the lr schedule, the constraint hooks) and validate the same way.

A step is two calls, so a driver can act between them (the simulated runner averages gradients over its
in-process replicas there):

    loss = replica.backward(micro_batches)        # gradients complete; the DP sync's after_backward ran
    record = replica.update(step, loss.item())    # clip, guard, optimiser, schedule, hooks, DP sync after_step

The trainer's device guard passes the loss tensor and a `device_judge` instead, and nothing is read back between
the forward and the optimiser step (nanotron_ext.train.step_guard).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Optional, Union

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext

from nanotron_ext.config.schema import Config
from nanotron_ext.errors import TrainingError
from nanotron_ext.metrics.nvtx import nvtx_range
from nanotron_ext.models.build import build_dp_sync, build_model, replica_config
from nanotron_ext.optim.build import build_optimizer
from nanotron_ext.optim.clip import clip_grad_norm_device_
from nanotron_ext.optim.lr_schedule import build_scheduler
from nanotron_ext.optim.skip import skipped_where
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.parallel.data_parallel import DataParallelSync
from nanotron_ext.parallel.link import LinkEmulator
from nanotron_ext.train.checkpoint_store import latest_checkpoint, resume_hint
from nanotron_ext.train.pipeline_step import evaluate, forward_backward, make_engine

Batch = Dict[str, torch.Tensor]


class Replica:
    """This process's part of DP replica `index`: its model (built from the replica's config), optimiser,
    schedule, pipeline engine and DP sync."""

    def __init__(self, cfg: Config, ctx: ParallelContext, index: int, *, link: Optional[LinkEmulator] = None,
                 local: bool = False) -> None:
        """`local`: the replica does not talk to the others (the simulated runner combines them itself), so
        its DP sync does nothing; otherwise it is parallelism.dp_sync over ctx's DP group."""
        self.cfg, self.ctx, self.index = cfg, ctx, index
        torch.manual_seed(cfg.general.seed)  # every replica builds the same weights
        self.model_cfg = replica_config(cfg, index)  # differs per replica e.g. in heterogeneous SparseLoCo
        self.model = build_model(self.model_cfg, ctx, link=link)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, ctx.tp_pg)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.tokens.train_steps)
        self.engine = make_engine(cfg.parallelism.pp_engine)
        self.dp_sync = (DataParallelSync(self.model, ctx, self.model_cfg) if local
                        else build_dp_sync(self.model_cfg, self.model, ctx))

    def autocast(self) -> contextlib.AbstractContextManager:
        """model.dtype bf16: autocast over the fp32 master weights."""
        if self.cfg.model.dtype == "bf16":
            return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, micro_batches: List[Batch]) -> torch.Tensor:
        """Accumulate this step's gradients; the loss (mean over the micro-batches and the DP group)."""
        with nvtx_range("forward_backward"), self.autocast():
            return forward_backward(self.model, self.engine, micro_batches, self.ctx, self.dp_sync)

    def update(self, step: int, loss: Union[float, torch.Tensor],
               judge: Optional[Callable[[float, float], None]] = None, *,
               device_judge: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
               ) -> Dict[str, Union[float, torch.Tensor]]:
        """Finish optimiser step `step` (1-based) after `backward`; `loss` is the step's loss to report.
        Before the optimiser step `judge(loss, grad_norm)` may stop the run (every rank together, raising);
        by default a TrainingError when the loss or the gradient norm is not finite on any rank.

        With `device_judge(loss, grad_norm) -> verdict` instead (the trainer's device guard; `loss` a device
        tensor) nothing is read back to the host: the optimiser, which must skip on the device
        (nanotron_ext.optim.skip), leaves the step's weights and state as they were where the verdict is 1, and the
        returned loss and grad_norm are device tensors."""
        with nvtx_range("clip_grad"):
            norm = clip_grad_norm_device_(self.model.parameters(), self.cfg.optimizer.clip_grad, self.ctx.tp_pg,
                                          self.ctx.pp_pg)
        lr = self.optimizer.param_groups[0]["lr"]
        if device_judge is not None:
            verdict = device_judge(loss, norm)
            with skipped_where(self.optimizer, verdict):
                self._step(step)
            return {"loss": loss, "grad_norm": norm, "lr": lr}
        grad_norm = float(norm)
        if judge is not None:
            judge(loss, grad_norm)
        elif self.any_rank(not (math.isfinite(loss) and math.isfinite(grad_norm))):
            hint = resume_hint(self.cfg.checkpoints.dir, latest_checkpoint(self.cfg.checkpoints.dir))
            raise TrainingError(f"step {step}: the loss is {loss} and the gradient norm {grad_norm} (not finite); "
                                f"stopped before the optimizer step, nothing was saved. {hint}; "
                                "lower optimizer.lr or check the model.* values")
        self._step(step)
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr}

    def _step(self, step: int) -> None:
        with nvtx_range("optimizer_step"):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.after_optimizer_step()
            self.dp_sync.after_step(step)

    def validation_losses(self, batches: List[Batch]) -> List[torch.Tensor]:
        """The loss of each group of batch_accumulation_per_replica validation batches (mean over the DP group)."""
        n = self.cfg.tokens.batch_accumulation_per_replica
        losses = []
        for i in range(0, len(batches), n):
            with nvtx_range("validation"), self.autocast():
                losses.append(evaluate(self.model, self.engine, batches[i:i + n], self.ctx))
        return losses

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any: all ranks must stop (or go on) together."""
        t = torch.tensor([float(flag)], device=self.ctx.device)
        with get_ledger().tag("control"):  # counted like every byte, under world all_reduce:control
            dist.all_reduce(t, group=self.ctx.world_pg)
        return bool(t.item())


def validation_summary(group_losses: List[float]) -> Dict[str, float]:
    """val_loss (mean over the groups) and val_ppl."""
    val = sum(group_losses) / len(group_losses)
    return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
