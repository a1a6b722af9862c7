"""BOOST's scripts time what the paper times (pure bf16, sec. 5.2): under model.dtype bf16 every GEMM and attention
call inside a timed block, part or GEMM closure gets bf16 inputs with bf16 weights, neither fp32 nor autocast
over fp32 weights; under fp32 nothing changes. Each script's own worker runs on 2 gloo ranks with a tiny
config while a TorchDispatchMode records what reaches aten's matmul and attention kernels inside its timed
closures. The harness helper (nanotron_ext.bench.workload.timing_precision) has its unit tests here too."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

from nanotron_ext.bench import workload
from tests.helpers.dist import run_distributed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from reproduce.boost import common as bc  # noqa: E402

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
SHAPE = ["model.hidden_size=32", "model.ffn_size=88", "model.low_rank.rank=8", "model.num_heads=4",
         "model.num_kv_heads=4", "model.num_layers=1", "model.vocab_size=512", "tokenizer.vocab_size=512",
         "model.max_seq_len=8", "tokens.sequence_length=8", "tokens.micro_batch_size=1", "parallelism.tp=2"]
Call = Tuple[str, Tuple[str, ...]]  # (aten op, its floating input dtypes)


def _recorder(calls: List[Call]) -> Any:
    """A TorchDispatchMode appending one Call per matmul / attention kernel it sees, and one ("reads an fp32
    parameter: <op>", ...) per op that takes an fp32 nn.Parameter: autocast's per-call cast of an fp32 weight
    (inside the kernel the autocast flag reads off, so the weights themselves are what tells)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    names = {torch.bfloat16: "bf16", torch.float32: "fp32"}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                       and t.is_floating_point()]
            attention = name.startswith(ATTENTION)
            if name in MATMULS or attention:
                # attention: the [b, h, s, hd] operands (its logsumexp [b, h, s] is fp32 by design)
                calls.append((name, tuple(sorted({names.get(t.dtype, str(t.dtype)) for t in tensors
                                                  if not attention or t.ndim == 4}))))
            # detach (p.data) computes nothing: timing_precision's own set-up reads the fp32 values that way
            if name != "detach" and any(isinstance(t, torch.nn.Parameter)
                                        and t.dtype == torch.float32 for t in tensors):
                calls.append((f"reads an fp32 parameter: {name}", ("fp32",)))
            return func(*args, **kwargs)

    return Record()


def _recording(fn: Callable[..., Any], calls: List[Call]) -> Callable[..., Any]:
    """`fn` with its first argument (the timed closure) run under the recorder."""
    def wrapped(closure: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            with _recorder(calls):
                return closure(*a, **k)
        return fn(run, *args, **kwargs)
    return wrapped


def _gemm_recording(fn: Callable[..., Any], calls: List[Call]) -> Callable[..., Any]:
    """fig7's gemm_seconds(x, w, ...) run under the recorder."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _recorder(calls):
            return fn(*args, **kwargs)
    return wrapped


def _scripts_worker(paths: Dict[str, Dict[str, str]]) -> Dict[str, List[Call]]:
    """On each rank: every BOOST script's worker (one iteration) with the timing closures recorded."""
    import importlib

    from nanotron_ext.bench import launch, timing
    from nanotron_ext.config import load_config

    t3, t5 = (importlib.import_module(f"reproduce.boost.{m}") for m in ("table3_grouping", "table5_checkpointing"))
    f7 = importlib.import_module("reproduce.boost.fig7_compute")
    out: Dict[str, List[Call]] = {}
    timed = timing.timed
    for script, mod in (("table3_grouping", t3), ("table5_checkpointing", t5), ("fig7_compute", f7)):
        calls: List[Call] = []
        timing.timed = _recording(timed, calls)  # table3 (via interleaved) and table5 time through it
        gemm_seconds = getattr(mod, "gemm_seconds", None)
        if gemm_seconds is not None:  # fig7 times single GEMMs directly
            mod.gemm_seconds = _gemm_recording(gemm_seconds, calls)
        try:
            args = argparse.Namespace(configs=list(paths[script].values()), names=list(paths[script]), batches="1",
                                      iters=1, warmup=0, reps=1, peak_size=256)
            mod.measure_worker(args)
        finally:
            timing.timed = timed
            if gemm_seconds is not None:
                mod.gemm_seconds = gemm_seconds
        out[script] = calls
    calls = []  # the block measurement iter_compare makes beside its timings (TP bytes per block)
    for path in paths["block_comm"].values():
        cfg = load_config(path)
        ctx = launch.init_distributed(cfg)
        model = workload.build_trainee(cfg, ctx, with_optimizer=False).model
        with _recorder(calls):
            bc.block_comm(cfg, model, ctx, 1)
    out["block_comm"] = calls
    return out


def _configs(tmp_path: Path, dtype: str) -> Dict[str, Dict[str, str]]:
    """Each script's variants (as its orchestrator builds them) written as YAML files for the workers."""
    from nanotron_ext.config.loader import save_config

    def cfg(*extra: str) -> Any:
        return workload.resolve_config(None, SHAPE + [f"model.dtype={dtype}", *extra])

    variants = {
        "table3_grouping": {g: cfg(*bc.strategy_overrides("btp", "cola"), f"model.boost.group_linears={g}")
                            for g in ("false", "true")},
        "table5_checkpointing": {f"{s}/{c}": cfg(*bc.strategy_overrides(s, "cola"),
                                                 f"model.boost.lowrank_checkpointing={c}")
                                 for s in ("vanilla", "btp") for c in ("false", "true")},
        "fig7_compute": {s: cfg(*bc.strategy_overrides(s, "cola")) for s in bc.DESIGNS},
        "block_comm": {s: cfg(*bc.strategy_overrides(s, "cola")) for s in bc.DESIGNS},
    }
    out: Dict[str, Dict[str, str]] = {}
    for script, named in variants.items():
        out[script] = {}
        for i, (name, c) in enumerate(named.items()):
            path = tmp_path / f"{script}_{i}.yaml"
            save_config(c, path)
            out[script][name] = str(path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_timed_closures_compute_in_the_papers_precision(tmp_path: Path, dtype: str) -> None:
    """bf16: every matmul and attention input inside the timed closures is bf16 and no op reads an fp32
    parameter (the weights themselves are bf16, as in the paper), so an fp32 GEMM or autocast over fp32 weights
    fails; fp32: every input is fp32 (the CPU results stay what they were)."""
    runs = run_distributed(_scripts_worker, 2, _configs(tmp_path, dtype))
    wrong: Dict[str, List[Call]] = {}
    for rank in runs:
        assert set(rank) == {"table3_grouping", "table5_checkpointing", "fig7_compute", "block_comm"}
        for script, calls in rank.items():
            ops = {name for name, _ in calls}
            assert ops & {"mm", "addmm", "bmm", "baddbmm"}, (script, ops)  # something was recorded at all
            if script != "fig7_compute":  # fig7 times the linears alone; the blocks run their attention core
                assert any(op.startswith(ATTENTION) for op in ops), (script, ops)
            bad = sorted({c for c in calls if c[1] != (dtype,)})  # fp32 here: fp32 parameters are expected
            if bad:
                wrong[script] = bad[:6]
    assert not wrong, f"{dtype} config, but these kernels got other inputs: {wrong}"


# ------------------------------------------------------------------------------------------------
# the helper
# ------------------------------------------------------------------------------------------------
def _block_and_cfg(dtype: str) -> Tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    block.register_buffer("table", torch.ones(3))
    return block, workload.resolve_config(None, [f"model.dtype={dtype}"])


def test_timing_precision_fp32_changes_nothing() -> None:
    import torch

    block, cfg = _block_and_cfg("fp32")
    before = [(p, p.data_ptr(), p.dtype) for p in block.parameters()]
    x = torch.randn(2, 4, requires_grad=True)
    with workload.timing_precision(cfg, [block], torch.device("cpu"), "pure") as cast:
        assert cast(x) is x and not torch.is_autocast_enabled("cpu")
        assert all(p.data_ptr() == ptr and p.dtype == dt for p, ptr, dt in before)  # the same storage, untouched
    assert workload.precision_label(cfg, "pure") == "fp32"


def test_timing_precision_pure_bf16_casts_weights_and_inputs_and_restores_them() -> None:
    import torch

    block, cfg = _block_and_cfg("bf16")
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    ids = torch.arange(3)
    with workload.timing_precision(cfg, [block, block], torch.device("cpu"), "pure") as cast:
        assert {p.dtype for p in block.parameters()} == {torch.bfloat16} and block.table.dtype == torch.float32
        x = cast(torch.randn(2, 4, requires_grad=True))
        assert x.dtype == torch.bfloat16 and x.is_leaf and x.requires_grad and cast(ids) is ids
        assert not torch.is_autocast_enabled("cpu")
        block(x).sum().backward()
        assert x.grad.dtype == torch.bfloat16
    for n, p in block.named_parameters():  # the fp32 values themselves, not a bf16 round trip
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n]) and p.grad is None, n
    assert workload.precision_label(cfg, "pure") == "bf16 (bf16 weights and inputs)"


def test_timing_precision_autocast_keeps_fp32_weights() -> None:
    import torch

    block, cfg = _block_and_cfg("bf16")
    with workload.timing_precision(cfg, [block], torch.device("cpu"), "autocast") as cast:
        x = torch.randn(2, 4)
        assert cast(x) is x and torch.is_autocast_enabled("cpu")
        assert {p.dtype for p in block.parameters()} == {torch.float32}
        assert block[0](x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        with workload.timing_precision(cfg, [block], torch.device("cpu"), "fp8"):
            pass
