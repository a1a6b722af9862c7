"""The optimizer the trainer uses: AdamW everywhere, or TP-aware Muon on hidden matrices + AdamW on the rest."""
from __future__ import annotations

from collections import ChainMap, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import nanotron.distributed as dist
import torch

from nanotron_ext.config.schema import OptimizerConfig
from nanotron_ext.optim.muon_tp import TensorParallelMuon
from nanotron_ext.optim.param_groups import split_params
from nanotron_ext.registry import OPTIMIZER_GROUPS


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped, zeroed, saved and loaded as one.

    `param_groups` is the concatenation of the children's own group dicts, so an lr scheduler
    (e.g. LambdaLR) writes each group's lr straight into the child that reads it, and scales each
    group's own peak (`initial_lr`). Groups carry a "name" key for logging.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.optimizers: List[torch.optim.Optimizer] = list(optimizers)
        # Optimizer.__init__ is skipped on purpose: it would copy the children's groups into new
        # dicts that the children never read. What it would set up for hooks is set up here.
        self.defaults: Dict[str, Any] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        # Rebuilt on each access: a child's load_state_dict replaces its group dicts.
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> ChainMap:  # type: ignore[override]
        """Read view of the children's per-parameter state."""
        return ChainMap(*(o.state for o in self.optimizers))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise TypeError("ChainedOptimizer: add the group to one of `optimizers` instead")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        children = state_dict["optimizers"]
        if len(children) != len(self.optimizers):
            raise ValueError(f"state dict holds {len(children)} optimizers, this one has {len(self.optimizers)}")
        for o, sd in zip(self.optimizers, children):
            o.load_state_dict(sd)


def adamw_flags(impl: str, device: torch.device) -> Dict[str, bool]:
    """torch.optim.AdamW's `fused` / `foreach` for optimizer.adamw_impl on `device` (see OptimizerConfig)."""
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "for_loop"
    if device.type == "meta" and impl == "fused":  # the planner: fused has no meta kernel; same state, for-loop step
        impl = "for_loop"
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def _adamw(groups: List[Dict[str, Any]], cfg: OptimizerConfig) -> torch.optim.AdamW:
    flags = adamw_flags(cfg.adamw_impl, groups[0]["params"][0].device)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                            **flags)

    def keep_flags(optimizer: torch.optim.Optimizer) -> None:
        # load_state_dict restores the saved groups' fused/foreach (a checkpoint from a CPU run would turn a CUDA
        # run's fused step back into the for-loop, or the reverse); the fused step wants its `step` on the device
        for group in optimizer.param_groups:
            group.update(flags)
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if flags["fused"] and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    opt.register_load_state_dict_post_hook(keep_flags)
    return opt


_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimizerConfig,
    tp_pg: Optional[dist.ProcessGroup],
    *,
    nesterov: bool = True,
    adjust_lr_fn: Optional[str] = None,
    ns_steps: int = 5,
    gather_dtype: Optional[torch.dtype] = torch.bfloat16,
) -> torch.optim.Optimizer:
    """The optimizer for `cfg.name` over `model`'s trainable parameters.

    adamw: torch.optim.AdamW with two groups, "adamw_decay" (matrices) and "adamw_no_decay"
        (norms, biases, 1-D: weight_decay 0).
    muon: ChainedOptimizer([TensorParallelMuon, AdamW]). Muon group "muon" (2-D hidden matrices,
        see `is_muon_param`): peak lr `muon_lr`, momentum `muon_momentum`, decoupled weight decay
        `weight_decay` (torch's Muon multiplies by 1 - lr * wd, lr before the shape adjustment).
        The remaining knobs are torch.optim.Muon's: nesterov, adjust_lr_fn (default
        `optimizer.muon_adjust_lr`; "original" =
        sqrt(max(1, rows/cols)) on the FULL matrix shape, or "match_rms_adamw" = 0.2 *
        sqrt(max(rows, cols))), ns_steps; gather_dtype: see TensorParallelMuon.
        The AdamW groups are as above with peak lr `lr`.

    Parameters a technique tagged (param_groups.tag_parameter) go to the optimiser that technique builds
    for the tag (its Pieces.optimizer; the tag is declared under "optimizer group"), chained after the
    default ones.

    Every group's lr starts at its peak; build_scheduler scales each by the same multiplier.
    Collective over tp_pg for muon when the model has TP-sharded matrices.
    """
    use_muon = cfg.name == "muon"
    adjust_lr_fn = adjust_lr_fn or cfg.muon_adjust_lr
    split = split_params(model.named_parameters(), use_muon=use_muon)
    extra = [OPTIMIZER_GROUPS.owner(tag).pieces_class().optimizer(tag, [p for _, p in named], cfg)
             for tag, named in sorted(split.tagged.items())]
    adamw_groups = [
        {"params": [p for _, p in named], "weight_decay": wd, "name": name}
        for name, named, wd in (
            ("adamw_decay", split.adamw_decay, cfg.weight_decay),
            ("adamw_no_decay", split.adamw_no_decay, 0.0),
        )
        if named
    ]
    if not use_muon and not extra:
        if not adamw_groups:
            raise ValueError("build_optimizer: the model has no trainable parameters")
        return _adamw(adamw_groups, cfg)

    optimizers: List[torch.optim.Optimizer] = []
    if split.muon:  # empty unless use_muon
        optimizers.append(TensorParallelMuon(
            [{"params": [p for _, p in split.muon], "name": "muon"}],
            lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=nesterov,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, tp_pg=tp_pg,
            # a bf16 gather only saves bytes when the orthogonaliser casts to bf16 anyway
            gather_dtype=gather_dtype if cfg.muon_ns_dtype == "bf16" else None,
            orthogonaliser=cfg.muon_orthogonaliser, ns_dtype=_NS_DTYPES[cfg.muon_ns_dtype],
        ))
    if adamw_groups:
        optimizers.append(_adamw(adamw_groups, cfg))
    return ChainedOptimizer(optimizers + extra)
