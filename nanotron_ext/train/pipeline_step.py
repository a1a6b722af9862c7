"""One optimiser step's forward/backward over micro-batches through nanotron's pipeline engines."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from nanotron import distributed as dist
from nanotron.parallel import ParallelContext
from nanotron.parallel.pipeline_parallel.engine import (
    AllForwardAllBackwardPipelineEngine,
    OneForwardOneBackwardPipelineEngine,
    PipelineEngine,
)
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from torch import nn

from nanotron_ext.parallel.data_parallel import DataParallelSync, GradientAllReduce

ENGINES = {"afab": AllForwardAllBackwardPipelineEngine, "1f1b": OneForwardOneBackwardPipelineEngine}


def make_engine(name: str) -> PipelineEngine:
    if name not in ENGINES:
        raise ValueError(f"parallelism.pp_engine={name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name]()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on `device`. On CUDA through pinned memory, asynchronously: a blocking copy (or an asynchronous one
    from pageable memory) waits for the stream, draining the queue at every step's start (issue 40)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)  # the pinned block is kept until the copy is done
    return t.to(device)


def place_micro_batch(batch: Dict[str, torch.Tensor], parallel_context: ParallelContext) -> Dict[str, object]:
    """Keep input_ids on the first stage and label_ids on the last; TensorPointers elsewhere."""
    pp_rank, last = dist.get_rank(parallel_context.pp_pg), parallel_context.pp_pg.size() - 1
    device = parallel_context.device
    return {
        "input_ids": _to_device(batch["input_ids"], device) if pp_rank == 0 else TensorPointer(group_rank=0),
        "label_ids": _to_device(batch["label_ids"], device) if pp_rank == last else TensorPointer(group_rank=last),
    }


def _mean_loss(outputs: List[Dict[str, object]], parallel_context: ParallelContext) -> torch.Tensor:
    """Mean micro-batch loss, known on every rank (broadcast from the last stage, averaged over DP)."""
    pp_pg = parallel_context.pp_pg
    last = pp_pg.size() - 1
    if dist.get_rank(pp_pg) == last:
        loss = torch.stack([o["loss"] for o in outputs]).sum().detach().float()  # engine pre-divides by n
    else:
        loss = torch.zeros((), device=parallel_context.device)
    if pp_pg.size() > 1:
        dist.broadcast(loss, src=dist.get_global_rank(pp_pg, last), group=pp_pg)
    if parallel_context.dp_pg.size() > 1:
        dist.all_reduce(loss, group=parallel_context.dp_pg)
        loss /= parallel_context.dp_pg.size()
    return loss


def forward_backward(
    model: nn.Module,
    engine: PipelineEngine,
    micro_batches: List[Dict[str, torch.Tensor]],
    parallel_context: ParallelContext,
    dp_sync: Optional[DataParallelSync] = None,
) -> torch.Tensor:
    """Accumulate gradients of the mean loss over `micro_batches`, hand them to `dp_sync` (default:
    average over DP); return the loss."""
    placed = [place_micro_batch(mb, parallel_context) for mb in micro_batches]
    outputs = engine.train_batch_iter(
        model, pg=parallel_context.pp_pg, batch=iter(placed), nb_microbatches=len(placed), grad_accumulator=None
    )
    model.after_backward()
    (dp_sync or GradientAllReduce(model, parallel_context)).after_backward()
    return _mean_loss(outputs, parallel_context)


@torch.no_grad()
def evaluate(
    model: nn.Module, engine: PipelineEngine, micro_batches: List[Dict[str, torch.Tensor]],
    parallel_context: ParallelContext
) -> torch.Tensor:
    """Mean loss over `micro_batches` without gradients (nanotron's validate_batch_iter, patch 0005)."""
    placed = [place_micro_batch(mb, parallel_context) for mb in micro_batches]
    outputs = engine.validate_batch_iter(model, batch=iter(placed), nb_microbatches=len(placed))
    return _mean_loss(outputs, parallel_context)

