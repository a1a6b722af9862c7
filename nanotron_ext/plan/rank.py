"""One planned rank: rank R of the config's real dp x tp x pp layout, built and stepped in this process with
nothing real allocated.

- Process groups: torch's fake backend (a world of dp x tp x pp with this process as rank R; collectives and
  point-to-point calls are no-ops that still pass through nanotron.distributed, so the comm ledger counts them).
- Tensors: the meta device (exact shapes and dtypes, no storage). FakeTensorMode cannot hold nanotron's
  parameters: nn.Parameter of a FakeTensor stays a FakeTensor, not a NanotronParameter, and nanotron's TP layers
  mark their parameters sharded through that subclass.
- Values: there are none; every value reads as 0 (`MetaScalars`): loss.item(), the gradient norm, an any-rank
  flag, an emulated link's arrival time give 0, so the step takes its no-divergence, no-clipping, no-wait path,
  torch.nonzero finds nothing and torch.unique one value, so a message whose size depends on values
  (heterogeneous SparseLoCo's changed embedding entries, MAPL's rows of the distinct token ids) is planned at its
  smallest.
- Pipeline: one process per stage; headers cross through a real store (nanotron_ext.plan.wire).
- model.compile: the layers run eager (torch.compile's fused kernels keep fewer intermediates: an upper bound);
  the choices compile makes at build (the fused cross-entropy at TP = 1) stay.

One iteration is what the trainer and the simulated replicas both take (train.replica.Replica): every
micro-batch through the pipeline engine, the DP sync, clipping, the optimiser step, the schedule, the
constraint hooks; at step H of an outer loop (SparseLoCo's inner_steps) its outer sync. Two iterations run: the
first (the fewest micro-batches the engine takes) creates the optimiser state, which the second (the one
reported) carries through forward and backward; the peak is over both.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Dict, List

import torch
import torch.distributed as torch_dist
import torch.fx.experimental._config  # noqa: F401 - meta_nonzero_assume_all_nonzero
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from nanotron_ext.plan.kernels import FLOP_FORMULAS, MetaKernels

STEP_TIMEOUT_S = 900.0


class MetaScalars(TorchDispatchMode):
    """Every meta tensor reads as zeros: a value read off one (`.item()`, `float(t)`, `bool(t)`) is 0 of its dtype,
    torch.nonzero finds no entry and torch.unique one value. A planned step has no data; 0 keeps every guard on its
    ordinary path (finite loss, no stop, an arrival time already passed), and an empty nonzero agrees with a count
    read as 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        meta = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"
        if meta and func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        if meta and func is torch.ops.aten.nonzero.default:
            return torch.empty(0, args[0].dim(), dtype=torch.long, device="meta")
        if meta and func in (torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default):
            x = args[0]  # all zeros: one distinct value (none in an empty tensor)
            n = min(x.numel(), 1)
            return (torch.empty(n, dtype=x.dtype, device="meta"), torch.empty(x.shape, dtype=torch.long, device="meta"),
                    torch.empty(n, dtype=torch.long, device="meta"))
        return func(*args, **(kwargs or {}))


class PipelineMemTracker(MemTracker):
    """torch's MemTracker for a pipeline engine, which calls the model once per micro-batch: MemTracker takes a
    second top-level call for a new iteration and refuses it. Its per-module statistics (not used here) are
    cleared before each top-level forward; the peak and its split by category are kept."""

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


def _state_tensors(obj: Any, skip: set, depth: int = 4) -> List[torch.Tensor]:
    """Tensors held by `obj` (attributes, lists, dicts; modules and tensors in `skip` excluded): a DP sync's or a
    codec's own state (SparseLoCo's global copy and error feedback, a shared basis)."""
    out: Dict[int, torch.Tensor] = {}

    def walk(o: Any, d: int) -> None:
        if isinstance(o, torch.Tensor):
            if id(o) not in skip:
                out.setdefault(id(o), o)
        elif d <= 0 or isinstance(o, (torch.nn.Module, torch_dist.ProcessGroup, str, bytes, int, float)):
            return
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, d - 1)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                walk(v, d - 1)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("nanotron_ext"):
            for v in vars(o).values():
                walk(v, d - 1)

    walk(obj, depth)
    return list(out.values())


def _nbytes(tensors: List[torch.Tensor]) -> int:
    seen: Dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()  # shared storages count once (_cdata: the storage itself, not its wrapper)
    return sum(seen.values())


def _micro_batches(cfg: Any) -> List[Dict[str, torch.Tensor]]:
    t = cfg.tokens
    ids = lambda: torch.empty(t.micro_batch_size, t.sequence_length, dtype=torch.long, device="meta")  # noqa: E731
    return [{"input_ids": ids(), "label_ids": ids()} for _ in range(t.batch_accumulation_per_replica)]


def steps(cfg: Any, outer: bool = True) -> List[int]:
    """Step numbers of the two iterations: the second is the DP sync's first outer step (Technique.outer_every), or
    with `outer` False the step after it (an inner step, when the DP sync has them: what every other step sends)."""
    from nanotron_ext.registry import DP_SYNCS

    every = DP_SYNCS.owner(cfg.parallelism.dp_sync).outer_every(cfg)
    return [max(1, every - 1), max(2, every) + (0 if outer else 1)]


def iteration_batches(micro: List[Any], iteration: int, pp: int) -> List[Any]:
    """The first iteration only creates the optimiser state: the fewest micro-batches the 1F1B engine takes (pp - 1,
    at least 1; every rank alike) do it."""
    return micro if iteration else micro[:max(1, pp - 1)]


def plan_rank(cfg: Any, rank: int, store_host: str, store_port: int, outer: bool = True,
              device: str = "cuda") -> Dict[str, Any]:
    """Build rank `rank` of `cfg`'s layout over the fake backend, step it twice, report the second iteration (an
    outer step of the DP sync, or with `outer` False an inner one: `steps`), its memory as `device` (cuda, cpu)
    allocates it (nanotron_ext.plan.kernels)."""
    from nanotron import distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.link import link_emulator_from_config
    from nanotron_ext.plan.wire import plannable
    from nanotron_ext.train.replica import Replica

    p = cfg.parallelism
    world = p.dp * p.tp * p.pp
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    torch_dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    ctx = build_parallel_context(p.dp, p.tp, p.pp, backend="gloo")  # "gloo": nanotron's CPU path; the groups are fake
    ctx.device = torch.device("meta")
    store = torch_dist.TCPStore(store_host, store_port, is_master=False,
                                timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    dp_rank, pp_rank, tp_rank = dist.get_rank(ctx.dp_pg), dist.get_rank(ctx.pp_pg), dist.get_rank(ctx.tp_pg)
    with torch.device("meta"):
        replica = Replica(cfg, ctx, dp_rank, link=link_emulator_from_config(p.link))
    plannable(replica.model._p2p, store)
    for module in replica.model.modules():  # model.compile: planned eager (its fused kernels only save memory)
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    # the step's precision context (torch.autocast has no meta backend): see nanotron_ext.plan.kernels
    low = torch.bfloat16 if cfg.model.dtype == "bf16" else None
    replica.autocast = lambda: MetaKernels(low, device)  # type: ignore[method-assign]
    params = list({id(q): q for q in replica.model.parameters()}.values())
    skip = {id(q) for q in params}
    extra = _state_tensors(replica.dp_sync, skip) + _state_tensors(replica.model.techniques, skip)
    tracker = PipelineMemTracker()
    tracker.track_external(replica.model, replica.optimizer, *extra)
    ledger = get_ledger()
    flops = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    micro = _micro_batches(cfg)
    # torch.nonzero inside a meta kernel (boolean-mask indexing) does not reach MetaScalars: it takes every entry
    with MetaScalars(), tracker, torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
        for i, step in enumerate(steps(cfg, outer)):
            ledger.reset()
            with flops if i == 1 else contextlib.nullcontext():  # FLOPs of the reported iteration
                loss = replica.backward(iteration_batches(micro, i, p.pp))
                replica.update(step, float(loss))
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("meta"), {})
    optimizers = getattr(replica.optimizer, "optimizers", [replica.optimizer])  # a ChainedOptimizer's children
    by_optimizer = {f"{i}:{type(o).__name__}": [v for st in o.state.values() for v in st.values()
                                                if isinstance(v, torch.Tensor)] for i, o in enumerate(optimizers)}
    optimizer_state = [v for state in by_optimizer.values() for v in state]
    return {
        "rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "tp_rank": tp_rank,
        "codec": replica.model_cfg.model.codec.kind,
        "parameters": sum(q.numel() for q in params), "parameter_bytes": _nbytes(params),
        "gradient_bytes": sum(q.nbytes for q in params if q.requires_grad),  # .grad has its parameter's dtype
        "optimizer_state_bytes": _nbytes(optimizer_state), "other_state_bytes": _nbytes(extra),
        "optimizer_state_by_optimizer": {k: _nbytes(v) for k, v in by_optimizer.items()},
        "peak": {str(k.value if hasattr(k, "value") else k): int(v) for k, v in peak.items()},
        "flops": int(flops.get_total_flops()),
        "flops_by_op": {str(op): int(n) for op, n in flops.get_flop_counts().get("Global", {}).items()},
        "ledger": ledger.snapshot(),
    }
