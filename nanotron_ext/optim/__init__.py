"""Optimizers, parameter groups, lr schedule and gradient clipping for the trainer.

    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    sched = build_scheduler(opt, cfg.optimizer, cfg.tokens.train_steps)
    ... backward ...
    grad_norm = clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad, ctx.tp_pg, ctx.pp_pg)
    opt.step(); sched.step(); opt.zero_grad()
"""
from nanotron_ext.optim.build import ChainedOptimizer, build_optimizer
from nanotron_ext.optim.clip import clip_grad_norm_
from nanotron_ext.optim.lr_schedule import build_scheduler, lr_lambda
from nanotron_ext.optim.muon_tp import TensorParallelMuon
from nanotron_ext.optim.param_groups import ParamSplit, is_muon_param, split_params, uses_weight_decay

__all__ = [
    "ChainedOptimizer",
    "ParamSplit",
    "TensorParallelMuon",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm_",
    "is_muon_param",
    "lr_lambda",
    "split_params",
    "uses_weight_decay",
]
