"""Workloads: the model/batch options scripts share, configs, built models, the precision a block timed
outside the trainer computes in (timing_precision), memory probes.

Techniques are reached by name only: a row is a config plus `--set` overrides
(`model.tp_strategy=btp`, `model.codec.kind=...`), built by the core's model builder, which
looks the names up in the registries (nanotron_ext.registry). Nothing here imports a technique.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from nanotron_ext.cli_flags import InputFile, Int, KeyValue
from nanotron_ext.config.loader import apply_overrides, from_dict, load_config
from nanotron_ext.config.schema import Config
from nanotron_ext.registry import TP_STRATEGIES

# Defaults of the benchmark model when no --config-file is given: small enough that a 12-iteration
# run of each variant takes seconds on 2 CPU cores; MHA.
BENCH_DEFAULTS = {"hidden": 256, "layers": 4, "heads": 4, "ffn": 688, "vocab": 4096, "seq": 256,
                  "micro_batch": 2, "accum": 1, "dtype": "fp32"}
SHAPE_KEYS = {
    "hidden": "model.hidden_size", "layers": "model.num_layers", "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads", "ffn": "model.ffn_size", "vocab": "model.vocab_size",
    "rank": "model.low_rank.rank", "seq": "tokens.sequence_length", "micro_batch": "tokens.micro_batch_size",
    "accum": "tokens.batch_accumulation_per_replica", "dtype": "model.dtype",
}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--config-file / --set plus shape shortcuts; shortcuts left unset keep the file's values
    (or BENCH_DEFAULTS without a file)."""
    g = parser.add_argument_group("model and batch (shared by every variant)")
    g.add_argument("--config-file", default=None, type=InputFile(format="yaml"),
                   help="base YAML run config (e.g. reproduce/boost/llama_7b_btp.yaml)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config override applied to every variant (repeatable)")
    size = Int(1)  # every shape shortcut is a count of at least one
    g.add_argument("--hidden", type=size, help=f"hidden size d (default {BENCH_DEFAULTS['hidden']})")
    g.add_argument("--rank", type=size, help="low-rank width r (default d/4)")
    g.add_argument("--layers", type=size, help=f"decoder layers (default {BENCH_DEFAULTS['layers']})")
    g.add_argument("--heads", type=size, help=f"attention heads (default {BENCH_DEFAULTS['heads']})")
    g.add_argument("--kv-heads", type=size, help="key/value heads (default = heads, MHA)")
    g.add_argument("--ffn", type=size, help=f"SwiGLU width d_ff (default {BENCH_DEFAULTS['ffn']})")
    g.add_argument("--vocab", type=size, help=f"vocabulary (default {BENCH_DEFAULTS['vocab']})")
    g.add_argument("--seq", type=size, help=f"sequence length (default {BENCH_DEFAULTS['seq']})")
    g.add_argument("--micro-batch", type=size, help=f"micro-batch size (default {BENCH_DEFAULTS['micro_batch']})")
    g.add_argument("--accum", type=size, help="micro-batches per iteration (default 1)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], help="compute precision (default fp32)")
    g.add_argument("--low-rank-kind", choices=["svd", "cola", "lax"], default=None,
                   help="factorisation of the low-rank rows (default: the config's, else cola)")


def shape_overrides(args: argparse.Namespace) -> List[str]:
    """`--set` strings for the shape shortcuts (defaults apply only without a config file)."""
    out: List[str] = []
    values = {k: getattr(args, k, None) for k in SHAPE_KEYS}
    if args.config_file is None:
        for k, v in BENCH_DEFAULTS.items():
            if values.get(k) is None:
                values[k] = v
        if values.get("kv_heads") is None:
            values["kv_heads"] = values["heads"]
    for k, v in values.items():
        if v is not None:
            out.append(f"{SHAPE_KEYS[k]}={v}")
    if values.get("vocab") is not None:  # random token ids: the tokenizer only has to fit the table
        out.append(f"tokenizer.vocab_size={values['vocab']}")
    if args.config_file is None or args.seq is not None:
        out.append(f"model.max_seq_len={values['seq'] if values.get('seq') is not None else args.seq}")
    return out


def resolve_config(config_file: Optional[str], overrides: Sequence[str]) -> Any:
    """Config from an optional YAML file plus overrides, strictly validated by our loader."""
    if config_file is not None:
        return load_config(config_file, list(overrides))
    return from_dict(Config, apply_overrides(None, list(overrides)))


def available_strategies() -> Tuple[List[str], str]:
    """(registered TP strategy names, why some may be missing or ""): the registry loads every
    technique declared as an entry point, so this names what `model.tp_strategy` accepts."""
    return TP_STRATEGIES.names(), ""


def require_strategies(needed: Sequence[str]) -> List[str]:
    """The subset of `needed` that is registered; prints why the others are missing."""
    registered, why = available_strategies()
    for s in needed:
        if s not in registered:
            print(f"{s}: not available (tp_strategy not registered{'; ' + why if why else ''})", file=sys.stderr)
    return [s for s in needed if s in registered]


# ------------------------------------------------------------------------------------------------
# worker side: models, batches, iterations
# ------------------------------------------------------------------------------------------------
def autocast_for(cfg: Any, device: Any) -> contextlib.AbstractContextManager:
    # torch on the worker side only: orchestrators run without it
    import torch

    if cfg.model.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# How a paper computes the blocks, parts and closures it times outside a training step when it trains in bf16:
# "pure": bf16 weights and inputs (Megatron-LM's bf16 parameters); "autocast": torch.autocast over fp32 weights
# (this trainer's model.dtype bf16). A paper's reproduce/<paper>/common.py names its own.
PRECISIONS = ("pure", "autocast")


@contextlib.contextmanager
def timing_precision(cfg: Any, modules: Sequence[Any], device: Any, precision: str) -> Iterator[Callable[[Any], Any]]:
    """While open, `modules` compute as the paper times them in the config's dtype; yields `cast`, which gives a
    floating input tensor that dtype (a new leaf keeping requires_grad). Enter it outside the timed window: the
    casts are not part of what a paper times. model.dtype fp32: nothing changes (cast returns its argument).
    bf16 + "pure": every floating parameter of `modules` is bf16 inside, its fp32 value restored on exit
    (gradients made inside are dropped); buffers (RoPE tables) stay fp32, as the model computes them in fp32
    anyway. bf16 + "autocast": autocast_for over the fp32 weights, inputs unchanged."""
    # torch on the worker side only: orchestrators run without it
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if cfg.model.dtype != "bf16":
        yield lambda t: t
        return
    if precision == "autocast":
        with autocast_for(cfg, device):
            yield lambda t: t
        return
    params = {id(p): p for m in modules for p in m.parameters() if p.is_floating_point()}.values()
    saved = [(p, p.data) for p in params]

    def cast(t: Any) -> Any:
        if not t.is_floating_point():
            return t
        return t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad)

    try:
        for p, data in saved:
            p.data = data.to(torch.bfloat16)
        yield cast
    finally:
        for p, data in saved:
            p.data, p.grad = data, None


def precision_label(cfg: Any, precision: str) -> str:
    """What timing_precision makes of this config, for a result's meta and title."""
    if cfg.model.dtype != "bf16":
        return cfg.model.dtype
    return "bf16 (bf16 weights and inputs)" if precision == "pure" else "bf16 (autocast over fp32 weights)"


def random_micro_batches(cfg: Any, n: int, micro_batch: Optional[int] = None) -> List[Dict[str, Any]]:
    """`n` micro-batches of token ids drawn from general.seed: identical for every variant."""
    # torch on the worker side only: orchestrators run without it
    import torch

    g = torch.Generator().manual_seed(cfg.general.seed)
    mb = micro_batch or cfg.tokens.micro_batch_size
    s = cfg.tokens.sequence_length
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.model.vocab_size, (mb, s + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "label_ids": ids[:, 1:].contiguous()})
    return out


@dataclasses.dataclass
class Trainee:
    """A built model, its optimizer and the pipeline engine on this rank."""

    cfg: Any
    model: Any
    optimizer: Any
    engine: Any


def build_trainee(cfg: Any, ctx: Any, with_optimizer: bool = True) -> Trainee:
    """The model `cfg` describes (through the registries), its optimizer and pipeline engine."""
    # torch on the worker side only: orchestrators run without it
    import torch

    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.train.pipeline_step import make_engine

    torch.manual_seed(cfg.general.seed)
    model = build_model(cfg, ctx)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg) if with_optimizer else None
    return Trainee(cfg, model, opt, make_engine(cfg.parallelism.pp_engine))


def release(*objs: Any) -> None:
    """Drop references and return memory (GPU caches too) before the next model is built."""
    # torch on the worker side only: orchestrators run without it
    import torch

    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_iteration(t: Trainee, ctx: Any, batches: List[Dict[str, Any]]) -> None:
    """One training iteration as the trainer runs it: forward/backward over the micro-batches,
    gradient clipping, optimizer step, zero grads (no data loading, no logging)."""
    # the model stack (torch, nanotron) on the worker side only
    from nanotron_ext.optim.clip import clip_grad_norm_
    from nanotron_ext.train.pipeline_step import forward_backward

    with autocast_for(t.cfg, ctx.device):
        forward_backward(t.model, t.engine, batches, ctx)
    clip_grad_norm_(t.model.parameters(), t.cfg.optimizer.clip_grad, ctx.tp_pg, ctx.pp_pg)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def first_local_block(model: Any) -> Any:
    """The first decoder layer module that lives on this rank's pipeline stage."""
    for block in model.decoder:
        mod = getattr(block, "pp_block", None)
        if mod is not None:
            return mod
    raise RuntimeError("this pipeline stage holds no decoder layer")


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------
def persistent_bytes(model: Any, optimizer: Any) -> Dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (tied parameters counted once)."""
    # torch on the worker side only: orchestrators run without it
    import torch

    params = {id(p): p for p in model.parameters()}.values()
    wgt = sum(p.numel() * p.element_size() for p in params)
    grad = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    opt += v.numel() * v.element_size()
    return {"weights": wgt, "grads": grad, "optimizer": opt}


def peak_memory() -> int:
    """CUDA allocator peak on GPU (reset it with reset_peak), peak RSS of this process on CPU."""
    # the model stack (torch, nanotron) on the worker side only
    from nanotron_ext.metrics.memory import peak_memory_bytes

    return int(peak_memory_bytes())


def reset_peak(device: Any) -> None:
    # torch on the worker side only: orchestrators run without it
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocator_net_bytes(prof: Any, device: Any) -> int:
    """Bytes allocated minus bytes freed inside a profiled region (what the region leaves held)."""
    if getattr(device, "type", "cpu") == "cuda":
        return int(sum(getattr(e, "self_device_memory_usage", 0) for e in prof.events()))
    return int(sum(e.self_cpu_memory_usage for e in prof.events()))


class SavedTensorBytes:
    """Bytes of distinct storages saved for backward while active (saved_tensors_hooks), parameters
    and buffers excluded. Checkpoint frames keep their re-forward inputs outside the hook's view
    (e.g. inside dicts): pass `checkpoint_owners`, modules whose `checkpoint` attribute is the
    torch.utils.checkpoint.checkpoint they call, and those inputs are counted too (the wrapper is
    installed in this process only while active)."""

    def __init__(self, model: Any, checkpoint_owners: Sequence[Any] = ()) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self._owners = list(checkpoint_owners)
        self.storages: Dict[Tuple[str, int], int] = {}
        self._stack = contextlib.ExitStack()

    def _note(self, t: Any) -> None:
        # torch on the worker side only: orchestrators run without it
        import torch

        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in self._skip and st.nbytes():
                self.storages[(str(t.device), st.data_ptr())] = st.nbytes()
        elif isinstance(t, dict):
            for v in t.values():
                self._note(v)
        elif isinstance(t, (list, tuple)):
            for v in t:
                self._note(v)

    def _pack(self, t: Any) -> Any:
        self._note(t)
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _wrap(self, owner: Any) -> None:
        original = getattr(owner, "checkpoint", None)
        if original is None:
            return

        def counting_checkpoint(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            self._note(list(args))
            self._note({k: v for k, v in kwargs.items() if k != "use_reentrant"})
            return original(fn, *args, **kwargs)

        owner.checkpoint = counting_checkpoint
        self._stack.callback(setattr, owner, "checkpoint", original)

    def __enter__(self) -> "SavedTensorBytes":
        # torch on the worker side only: orchestrators run without it
        import torch

        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        for owner in self._owners:
            self._wrap(owner)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def activation_bytes(model: Any, forward: Callable[[], Any], device: Any,
                     checkpoint_owners: Sequence[Any] = ()) -> Tuple[Any, Dict[str, int]]:
    """Run `forward` (returns a loss); measure what it leaves held for backward two ways:
    allocator net bytes (profile_memory) and saved-for-backward bytes (hooks + checkpoint inputs).
    Returns (loss, {"allocator": .., "saved": ..}); call loss.backward() afterwards."""
    # torch.profiler on the worker side only
    from nanotron_ext.bench.timing import profiler_for

    with SavedTensorBytes(model, checkpoint_owners) as saved, profiler_for(device, memory=True) as prof:
        loss = forward()
    return loss, {"allocator": allocator_net_bytes(prof, device), "saved": saved.bytes}
