"""A run's model on one process (tp = pp = 1), from the tensors `gather` reassembled.

The single-process model must compute what the run's layout computed. Two settings of the run depend on its
layout and are made explicit here: the codec boundaries (`model.codec.boundaries: stages` means "after the last
layer of every stage", which on one process would be none, so it becomes the list of those layers; the codec then
runs in-process, as `every_layer` does) and the replica's own model config (heterogeneous SparseLoCo gives
replicas different codecs). Everything else (TP strategy, low rank, constraints) is layout-independent by design.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from nanotron_ext.config.compose import core_class
from nanotron_ext.config.schema import Config, ParallelismConfig
from nanotron_ext.inference.run import RunCheckpoint, RunError
from nanotron_ext.models.llama import LlamaForTraining
from nanotron_ext.parallel.context import init_portless, lone_rank_env, release_process_groups
from nanotron_ext.parallel.layout import codec_boundaries, split_layers


def single_process_config(ckpt: RunCheckpoint, replica: int = 0) -> Config:
    """The run's config for DP replica `replica` on one process (see the module doc)."""
    from nanotron_ext.models.build import replica_config

    cfg = replica_config(ckpt.config, replica)
    p, m = cfg.parallelism, cfg.model
    stages = split_layers(m.num_layers, p.pp, p.layers_per_stage)
    boundaries = codec_boundaries(m.codec.boundaries, stages)
    model = dataclasses.replace(m, codec=dataclasses.replace(m.codec, boundaries=boundaries), init_from=None)
    # one replica, no outer loop: the top-level technique sections (e.g. sparseloco) at their defaults
    core = {f.name for f in dataclasses.fields(core_class(type(cfg)))}
    outer = {f.name: f.default_factory() for f in dataclasses.fields(cfg) if f.name not in core}
    return dataclasses.replace(cfg, model=model, **outer,
                               parallelism=ParallelismConfig(dp=1, tp=1, pp=1, pp_engine=p.pp_engine))


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A world of one (gloo) for nanotron's ParallelContext while the one-process model is in use; destroyed on
    the way out when this opened it (a process that already has a world of one keeps it)."""
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        if torch_dist.get_world_size() != 1:
            raise RunError("generate/eval run on one process; this one is part of a larger process group")
        yield
        return
    with lone_rank_env():
        try:
            init_portless("gloo")
            yield
        finally:
            release_process_groups()  # its gloo threads end here, not at interpreter exit


@torch.no_grad()
def load_single_process_model(ckpt: RunCheckpoint, raw: dict, replica: int = 0) -> LlamaForTraining:
    """Build the single-process model and load the reassembled tensors into it (every parameter and every
    persistent buffer must be found); inside `one_process_group()`."""
    from nanotron_ext.models.build import build_model
    from nanotron_ext.models.init import load_full_state_dict_
    from nanotron_ext.parallel.context import standalone_context

    cfg = single_process_config(ckpt, replica)
    ctx = standalone_context()
    model = build_model(cfg, ctx)
    try:
        load_full_state_dict_(model, raw)
    except KeyError as e:
        raise RunError(f"the one-process model has {e.args[0]}, which the checkpoint does not") from None
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            if name not in raw:
                raise RunError(f"the one-process model has buffer {name}, which the checkpoint does not")
            buffer.copy_(raw[name].to(buffer.dtype))
    model.eval()
    return model


def device(model: LlamaForTraining) -> torch.device:
    return next(model.parameters()).device


def autocast(model: LlamaForTraining) -> contextlib.AbstractContextManager:
    """The run's compute precision (model.dtype), as the trainer applies it."""
    if model.cfg.dtype == "bf16":
        return torch.autocast(device_type=device(model).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def logits(model: LlamaForTraining, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary fp32 logits [b, s, V] of the one-process model (on CPU)."""
    with autocast(model):
        return model.sharded_logits(input_ids.to(device(model))).float().cpu()
