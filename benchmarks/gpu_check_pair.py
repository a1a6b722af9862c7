"""The two loops the GPU check times against each other (benchmarks/gpu_check_jobs.py: throughput and profile jobs;
the memory job steps ours alone): nanotron_ext's training step as the trainer takes it, and the plain-PyTorch loop
of benchmarks/plain_llama.py, built from the same weights in one throughput setting.

Ours is `TrainerStep`: the trainer's own Replica and its step guard (Trainer.train_step without the data loader,
the step meter and the run folder), so a row times the path a training run takes. With general.step_guard auto and
the fused AdamW (optimizer.adamw_impl auto on CUDA) that is the device path of nanotron_ext.train.step_guard: nothing
read back between the forward and the optimizer step, the step's loss, gradient norm and verdict read a step later.
Which path ran is the line the trainer prints at start (`TrainerStep.path`), kept in every row.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List, Optional

import torch

from nanotron_ext.config.schema import Config
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.train.agreement import RankAgreement
from nanotron_ext.train.divergence import DivergenceGuard, weight_sq_norm
from nanotron_ext.train.replica import Replica
from nanotron_ext.train.step_guard import DeviceGuard, Readback, guard_path

_CONTEXTS: List[Any] = []  # the one ParallelContext of a job that builds models itself (throughput, codecs, memory)


def shared_context(cfg: Config) -> Any:
    """One ParallelContext per job process: its items build their models on it one after another."""
    from nanotron_ext.bench.launch import init_distributed

    if not _CONTEXTS:
        _CONTEXTS.append(init_distributed(cfg))
    return _CONTEXTS[0]


def fresh_compile() -> None:
    """Forget every compiled graph, and free the models they held: a module compiled in place and its compiled
    wrapper reference each other, so the last setting's models (32 GiB for the 1B pair) are freed only by the
    collector, once dynamo's caches let go of them."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attention(backend: Optional[str]) -> contextlib.AbstractContextManager:
    """SDPA restricted to one backend ("flash", "cudnn"), or as torch picks it (None)."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]])


class TrainerStep:
    """nanotron_ext's training iteration as Trainer.train_step takes it: Replica.backward, then Replica.update judged
    by the trainer's guard, on the device or on the host as guard_path decides for this config (one rank of a
    dp = tp = pp = 1 layout; the schedule steps as in training)."""

    def __init__(self, cfg: Config, ctx: Any) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.replica = Replica(cfg, ctx, 0)
        self.model, self.optimizer, self.engine = self.replica.model, self.replica.optimizer, self.replica.engine
        self.guard = DivergenceGuard(cfg.general.max_loss_ratio, cfg.general.max_weight_growth)
        self.agree = RankAgreement(ctx.world_pg, ctx.device, get_ledger(), True)
        on_device, self.path = guard_path(cfg, self.optimizer)
        self.device_guard = DeviceGuard(self.guard, self.agree, ctx.device) if on_device else None
        self.weights_sq = weight_sq_norm(self.model.parameters())  # of the weights the next step starts from
        self.step = 0
        self._readback: Optional[Readback] = None  # this step's guard values (device path)
        self.pending: Optional[Readback] = None  # the last step's, unread

    def __call__(self, batches: List[Dict[str, torch.Tensor]]) -> None:
        loss = self.replica.backward(batches)
        if self.device_guard is None:
            self.replica.update(self.step + 1, loss.item(), judge=self._judge)
        else:
            self.replica.update(self.step + 1, loss, device_judge=self._judge_on_device)
        self.weights_sq = weight_sq_norm(self.model.parameters())
        self.step += 1
        if self.pending is not None:  # the step before, read now that this one is queued behind it (as the trainer)
            self._settle(self.step - 1, self.pending)
        self.pending = self._readback

    def _judge_on_device(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        verdict, values = self.device_guard.judge(loss, grad_norm, self.weights_sq)
        self._readback = Readback(values)
        return verdict

    def _judge(self, loss: float, grad_norm: float) -> None:
        stop, weights_sq = self.agree.control(not (math.isfinite(loss) and math.isfinite(grad_norm)), self.weights_sq)
        self._readback = None
        self._refuse_if(self.step + 1, stop, loss, grad_norm, weights_sq)

    def _settle(self, step: int, readback: Readback) -> None:
        v = readback.read()
        self._refuse_if(step, bool(v.stop) or bool(v.refused), v.loss, v.grad_norm, v.weights_sq)

    def _refuse_if(self, step: int, stop: bool, loss: float, grad_norm: float, weights_sq: float) -> None:
        """The trainer's checks (Trainer._stop_if): a timing row of a diverged model would time something else."""
        problem = ("not finite, or refused by the device guard" if stop
                   else self.guard.check_weights(step - 1, weights_sq) or self.guard.check_loss(step, loss))
        if problem:
            raise RuntimeError(f"step {step}: {problem} (loss {loss}, gradient norm {grad_norm})")

    def finish(self) -> None:
        """Read the last step's verdict (the trainer reads it at the end of a run)."""
        if self.pending is not None:
            self._settle(self.step, self.pending)
            self.pending = None


def optimizer_name(optimizer: Any) -> str:
    group = optimizer.param_groups[0]
    impl = " (fused)" if group.get("fused") else " (foreach)" if group.get("foreach") else " (for-loop)"
    return type(optimizer).__name__ + impl


def build_pair(item: Dict[str, Any], plan: Dict[str, Any]) -> Dict[str, Any]:
    """Ours (TrainerStep) and the plain loop from the same weights in one throughput setting (`item`: compile,
    attention), their steps and batches."""
    import plain_llama as pl

    from nanotron_ext.bench import workload as bw
    from nanotron_ext.config.loader import load_config

    # a fresh compile per setting: dynamo's cache would otherwise serve one setting's graphs (attention backend
    # included) to the next model built from the same code
    fresh_compile()
    # the setting's attention backend applies to both models (around the step), not the config's model.attention
    cfg = load_config(plan["config_file"], list(plan["overrides"])
                      + [f"model.compile={str(item['compile']).lower()}", "model.attention=sdpa"])
    ctx = shared_context(cfg)
    ours = TrainerStep(cfg, ctx)
    with torch.device(ctx.device):  # built where it runs: a CPU init of a 1B model takes ~20 s, then load_from sets it
        plain = pl.PlainLlama(cfg.model)
    plain.load_from(ours.model)
    plain_opt = pl.make_optimizer(plain, cfg.optimizer)
    if item["compile"]:
        plain.compile_blocks()
    batches = [{k: v.to(ctx.device) for k, v in mb.items()}
               for mb in bw.random_micro_batches(cfg, cfg.tokens.batch_accumulation_per_replica)]
    bf16 = cfg.model.dtype == "bf16"
    steps = {"nanotron_ext": lambda: ours(batches),
             "plain": lambda: pl.train_step(plain, plain_opt, batches, cfg.optimizer.clip_grad, bf16)}
    return {"cfg": cfg, "ctx": ctx, "ours": ours, "plain": plain, "batches": batches, "steps": steps,
            "step_guard": ours.path,
            "optimizers": {"nanotron_ext": optimizer_name(ours.optimizer), "plain": optimizer_name(plain_opt)}}
