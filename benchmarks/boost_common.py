"""Shared pieces of the BOOST benchmarks (benchmarks/boost_*.py).

Every benchmark is one script with two roles: run plainly it is the *orchestrator* (resolves the
configs, launches `torchrun ... <script> --worker ...`, collects the JSON each launch writes and
prints the table); under torchrun with `--worker` it is the *worker* (builds the model on each
rank, measures, and global rank 0 writes the result JSON). The pure functions at the top (stats,
the Table 6 closed form, table formatting, argument splitting) are unit-tested in
tests/test_boost_bench.py.

Measurement rules shared by all scripts:
  * time: time.perf_counter around the measured region, a barrier on every rank before and after
    (and torch.cuda.synchronize on GPU), so one number covers the slowest rank; per-iteration times
    are max-reduced over ranks; the first `warmup` iterations are dropped and the rest summarised
    (mean, sample std, median, min, n).
  * communication: the comm ledger (patch 0007 hooks) counts the payload bytes and calls of every
    collective per group role; the TP numbers are the "tp" role.
  * activation memory: bytes the allocator still holds after a forward (torch.profiler with
    profile_memory, CPU and CUDA alike) and, beside it, bytes of tensors saved for backward
    (saved_tensors_hooks, unique storages, parameters and buffers excluded) plus the inputs that
    checkpoint frames keep for their re-forward.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

# torchrun arguments that mean "the user set up the rendezvous": then we do not add --standalone
_RDZV_FLAGS = ("--standalone", "--nnodes", "--rdzv", "--master", "--node", "--node_rank", "--node-rank")


# ================================================================================================
# pure functions (no torch.distributed): statistics, closed forms, tables, arguments
# ================================================================================================
@dataclasses.dataclass(frozen=True)
class Summary:
    """Post-warm-up statistics of per-iteration times (seconds)."""

    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); 0 for a single sample
    median: float
    min: float
    max: float

    @property
    def sem(self) -> float:
        """Standard error of the mean."""
        return self.std / math.sqrt(self.n) if self.n > 0 else float("nan")


def summarize(times: Sequence[float], warmup: int) -> Summary:
    """Drop the first `warmup` iterations and summarise the rest."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    kept = list(times)[warmup:]
    if not kept:
        raise ValueError(f"no iterations left after dropping {warmup} warm-up iterations of {len(times)}")
    std = statistics.stdev(kept) if len(kept) > 1 else 0.0
    return Summary(n=len(kept), mean=statistics.fmean(kept), std=std, median=statistics.median(kept),
                   min=min(kept), max=max(kept))


def speedup(reference: Summary, candidate: Summary) -> Tuple[float, float]:
    """(reference mean / candidate mean, its standard error by first-order error propagation of the
    two means' standard errors); > 1 means the candidate is faster."""
    s = reference.mean / candidate.mean
    rel = math.sqrt((reference.sem / reference.mean) ** 2 + (candidate.sem / candidate.mean) ** 2)
    return s, s * rel


def table6_tp_elements(strategy: str, b: int, s: int, d: int, d_ff: int, r: int) -> int:
    """BOOST Table 6: TP communication volume of ONE decoder block in ONE pass, in elements
    (full rank 2bsd, vanilla low-rank 5bsd + 2bs*d_ff, BTP 7bsr; norms/embedding omitted, MHA assumed)."""
    if strategy == "megatron":
        return 2 * b * s * d
    if strategy == "vanilla":
        return 5 * b * s * d + 2 * b * s * d_ff
    if strategy == "btp":
        return 7 * b * s * r
    raise ValueError(f"no Table 6 closed form for strategy {strategy!r}")


def fmt_bytes(n: Optional[float], unit: str = "KiB") -> str:
    if n is None:
        return "-"
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    return f"{n / scale:,.1f}"


def fmt_time_ms(summary: Optional[Summary]) -> str:
    if summary is None:
        return "-"
    return f"{summary.mean * 1e3:,.1f} +- {summary.std * 1e3:,.1f}"


def fmt_ratio(value: Optional[Tuple[float, float]]) -> str:
    if value is None:
        return "-"
    return f"{value[0]:.2f}x +- {value[1]:.2f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (left-aligned first column)."""
    cells = [[str(h) for h in headers]] + [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_rows(path: str | Path, rows: Sequence[Dict[str, Any]], meta: Optional[Dict[str, Any]] = None) -> Path:
    """Write result rows as JSON ({"meta", "rows"}) or, for a .csv path, CSV (flat columns only;
    nested values are JSON-encoded). Written to a temporary file, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as f:
        if path.suffix.lower() == ".csv":
            keys: List[str] = []
            for row in rows:
                keys += [k for k in row if k not in keys]
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for row in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
        else:
            json.dump({"meta": meta or {}, "rows": list(rows)}, f, indent=2, default=_json_default)
            f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are for everyone to read
    os.replace(tmp, path)
    return path


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(script arguments, torchrun arguments): everything after the first `--` goes to torchrun."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def torchrun_command(torchrun_args: Sequence[str], script: str | Path, script_args: Sequence[str]) -> List[str]:
    """`python -m torch.distributed.run ...` with the running interpreter. Defaults to 2 local CPU
    processes (TP=2) and adds --standalone (a free rendezvous port, so concurrent runs on one host
    do not collide) unless the caller set up the rendezvous."""
    args = list(torchrun_args) or ["--nproc_per_node", "2"]
    if not any(a.split("=")[0].startswith(_RDZV_FLAGS) for a in args):
        args = ["--standalone"] + args
    return [sys.executable, "-m", "torch.distributed.run", *args, str(script), *script_args]


def machine_label() -> str:
    """What the numbers were measured on, for titles and JSON meta."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - a label must never fail a run
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_meta(extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": machine_label(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    meta.update(extra or {})
    return meta


# ================================================================================================
# configs
# ================================================================================================
# Defaults of the benchmark model when no --config-file is given: small enough that a 12-iteration
# run of each strategy takes seconds on 2 CPU cores, MHA so that Table 6's closed forms apply.
BENCH_DEFAULTS = {"hidden": 256, "layers": 4, "heads": 4, "ffn": 688, "vocab": 4096, "seq": 256,
                  "micro_batch": 2, "accum": 1, "dtype": "fp32"}
SHAPE_KEYS = {
    "hidden": "model.hidden_size", "layers": "model.num_layers", "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads", "ffn": "model.ffn_size", "vocab": "model.vocab_size",
    "rank": "model.low_rank.rank", "seq": "tokens.sequence_length", "micro_batch": "tokens.micro_batch_size",
    "accum": "tokens.batch_accumulation_per_replica", "dtype": "model.dtype",
}


def add_model_args(parser: Any) -> None:
    """--config-file / --set plus shape shortcuts; shortcuts left unset keep the file's values
    (or BENCH_DEFAULTS without a file)."""
    g = parser.add_argument_group("model and batch (shared by every strategy)")
    g.add_argument("--config-file", default=None, help="base YAML run config (e.g. reproduce/boost/llama_7b_btp.yaml)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every strategy (repeatable)")
    g.add_argument("--hidden", type=int, help=f"hidden size d (default {BENCH_DEFAULTS['hidden']})")
    g.add_argument("--rank", type=int, help="low-rank width r (default d/4)")
    g.add_argument("--layers", type=int, help=f"decoder layers (default {BENCH_DEFAULTS['layers']})")
    g.add_argument("--heads", type=int, help=f"attention heads (default {BENCH_DEFAULTS['heads']})")
    g.add_argument("--kv-heads", type=int, help="key/value heads (default = heads, MHA as in Table 6)")
    g.add_argument("--ffn", type=int, help=f"SwiGLU width d_ff (default {BENCH_DEFAULTS['ffn']})")
    g.add_argument("--vocab", type=int, help=f"vocabulary (default {BENCH_DEFAULTS['vocab']})")
    g.add_argument("--seq", type=int, help=f"sequence length (default {BENCH_DEFAULTS['seq']})")
    g.add_argument("--micro-batch", type=int, help=f"micro-batch size (default {BENCH_DEFAULTS['micro_batch']})")
    g.add_argument("--accum", type=int, help="micro-batches per iteration (default 1)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], help="compute precision (default fp32)")
    g.add_argument("--low-rank-kind", choices=["svd", "cola", "lax"], default=None,
                   help="factorisation of the low-rank rows (default: the config's, else cola as in the paper)")


def shape_overrides(args: Any) -> List[str]:
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


def strategy_overrides(strategy: str, low_rank_kind: str, rmsnorm: Optional[str] = None) -> List[str]:
    """What turns the shared model into one compared row: full-rank Megatron, or a low-rank model
    under vanilla / bottleneck-aware TP."""
    if strategy == "megatron":
        return ["model.low_rank.kind=none", "model.boost.tp_strategy=megatron"]
    out = [f"model.low_rank.kind={low_rank_kind}", f"model.boost.tp_strategy={strategy}"]
    if rmsnorm is not None:
        out.append(f"model.boost.rmsnorm={rmsnorm}")
    return out


def base_low_rank_kind(config_file: Optional[str], overrides: Sequence[str], requested: Optional[str]) -> str:
    """The factorisation the low-rank rows use: --low-rank-kind, else the base config's, else cola."""
    if requested:
        return requested
    cfg = resolve_config(config_file, overrides)
    return cfg.model.low_rank.kind if cfg.model.low_rank.kind != "none" else "cola"


def resolve_config(config_file: Optional[str], overrides: Sequence[str]) -> Any:
    """Config from an optional YAML file plus overrides, strictly validated by our loader."""
    from nanotron_ext.config.loader import apply_overrides, from_dict, load_config
    from nanotron_ext.config.schema import Config

    if config_file is not None:
        return load_config(config_file, list(overrides))
    return from_dict(Config, apply_overrides(None, list(overrides)))


def available_strategies() -> Tuple[List[str], str]:
    """(registered TP strategy names, why the BOOST ones are missing or ""), without failing when
    the BOOST strategies module does not exist (yet)."""
    from nanotron_ext.models.tp_strategy import TP_STRATEGIES

    return TP_STRATEGIES.names(), ""


# ================================================================================================
# launching
# ================================================================================================
def launch(script: str | Path, worker_args: Sequence[str], torchrun_args: Sequence[str], log_path: Path,
           timeout_s: float, verbose: bool = False) -> Tuple[int, str]:
    """Run one torchrun job; (return code, last lines of its output). Output goes to `log_path`
    (and the terminal with verbose)."""
    cmd = torchrun_command(torchrun_args, script, worker_args)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stderr.write(line)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # our own job's process group only
            proc.wait()
            rc = 124
            log.write(f"\n[timed out after {timeout_s:.0f}s]\n")
    tail = log_path.read_text().strip().splitlines()[-15:]
    return rc, "\n".join(tail)


def last_error_line(tail: str) -> str:
    """The most informative line of a failed job's output (the exception message)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "error:", "Exception")) and not ln.startswith("File "):
            return ln[-200:]
    return lines[-1][-200:] if lines else "no output"


# ================================================================================================
# worker side (under torchrun)
# ================================================================================================
def adapt_layout(cfg: Any, world_size: int) -> None:
    """Fill the world with TP: tp = world / (dp * pp) when the config's grid does not match, so one
    config serves any --nproc_per_node. Re-validates the layout (shapes divisible by tp, ...)."""
    p = cfg.parallelism
    if p.dp * p.tp * p.pp != world_size:
        if world_size % (p.dp * p.pp):
            raise ValueError(f"world size {world_size} is not a multiple of dp*pp = {p.dp * p.pp}")
        p.tp = world_size // (p.dp * p.pp)
    cfg.validate(world_size=world_size)


def init_distributed(cfg: Any) -> Any:
    """nanotron's ParallelContext for this config (tp adapted to the world size)."""
    from nanotron_ext.parallel.context import build_parallel_context

    world = int(os.environ.get("WORLD_SIZE", "1"))
    adapt_layout(cfg, world)
    p = cfg.parallelism
    backend = None if cfg.general.backend == "auto" else cfg.general.backend
    return build_parallel_context(p.dp, p.tp, p.pp, backend=backend, timeout_s=cfg.general.collective_timeout_s)


def is_main() -> bool:
    import torch.distributed as td

    return not td.is_initialized() or td.get_rank() == 0


def sync_all(device: Any) -> None:
    """Finish queued GPU work and line up every rank (torch.distributed directly: not in the ledger)."""
    import torch
    import torch.distributed as td

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
    if td.is_initialized() and td.get_world_size() > 1:
        td.barrier()


def max_over_ranks(values: Sequence[float]) -> List[float]:
    """Element-wise max over all ranks (each iteration is as slow as its slowest rank)."""
    import torch
    import torch.distributed as td

    t = torch.tensor(list(values), dtype=torch.float64)
    if td.is_initialized() and td.get_world_size() > 1:
        if td.get_backend() == "nccl":
            t = t.cuda()
        td.all_reduce(t, op=td.ReduceOp.MAX)
    return [float(v) for v in t.cpu().tolist()]


def autocast_for(cfg: Any, device: Any) -> contextlib.AbstractContextManager:
    import torch

    if cfg.model.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def random_micro_batches(cfg: Any, n: int, micro_batch: Optional[int] = None) -> List[Dict[str, Any]]:
    """`n` micro-batches of token ids drawn from general.seed: identical for every strategy."""
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
    import torch

    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_iteration(t: Trainee, ctx: Any, batches: List[Dict[str, Any]]) -> None:
    """One training iteration as the trainer runs it: forward/backward over the micro-batches,
    gradient clipping, optimizer step, zero grads (no data loading, no logging)."""
    from nanotron_ext.optim.clip import clip_grad_norm_
    from nanotron_ext.train.pipeline_step import forward_backward

    with autocast_for(t.cfg, ctx.device):
        forward_backward(t.model, t.engine, batches, ctx)
    clip_grad_norm_(t.model.parameters(), t.cfg.optimizer.clip_grad, ctx.tp_pg, ctx.pp_pg)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


@dataclasses.dataclass
class Timings:
    """Per-iteration measurements: wall seconds and process CPU seconds (each max over ranks),
    seconds inside collectives (mean over ranks, only when profiled) and this rank's TP
    bytes/calls per iteration (only with a ledger)."""

    wall: List[float]
    cpu: List[float]
    comm: List[Dict[str, int]]
    comm_s: List[float] = dataclasses.field(default_factory=list)

    def extend(self, other: "Timings") -> None:
        self.wall += other.wall
        self.cpu += other.cpu
        self.comm += other.comm
        self.comm_s += other.comm_s


def timed(fn: Callable[[], Any], device: Any, iters: int, ledger: Any = None, profile: bool = False) -> Timings:
    """Run `fn` `iters` times between barriers. Wall time covers the slowest rank; CPU time
    (time.process_time of the call) is what this process computed, which other tenants' load on
    a shared machine barely changes (waiting in a collective sleeps). With `profile`, each
    iteration runs under torch.profiler (started and stopped outside the timed window) and the
    time spent in collectives during that same iteration is recorded."""
    wall, cpu, comm, comm_s = [], [], [], []
    for _ in range(iters):
        with (profiler_for(device) if profile else contextlib.nullcontext()) as prof:
            sync_all(device)
            if ledger is not None:
                ledger.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            c1 = time.process_time()
            if ledger is not None:  # read before the closing barrier (which is not a TP collective anyway)
                comm.append({"bytes": ledger.bytes(group="tp"), "calls": ledger.calls(group="tp")})
            sync_all(device)
            wall.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
        if profile:
            comm_s.append(comm_seconds(prof))
    return Timings(max_over_ranks(wall), max_over_ranks(cpu), comm, mean_over_ranks(comm_s) if profile else [])


def mean_over_ranks(values: Sequence[float]) -> List[float]:
    import torch
    import torch.distributed as td

    t = torch.tensor(list(values), dtype=torch.float64)
    if td.is_initialized() and td.get_world_size() > 1:
        if td.get_backend() == "nccl":
            t = t.cuda()
        td.all_reduce(t)
        t /= td.get_world_size()
    return [float(v) for v in t.cpu().tolist()]


def first_local_block(model: Any) -> Any:
    """The first decoder layer module that lives on this rank's pipeline stage."""
    for block in model.decoder:
        mod = getattr(block, "pp_block", None)
        if mod is not None:
            return mod
    raise RuntimeError("this pipeline stage holds no decoder layer")


def block_input(cfg: Any, model: Any, ctx: Any, micro_batch: int) -> Any:
    """A hidden-state input of one decoder block as this strategy lays it out: [b, s, d] with a
    replicated residual stream, [b, s, d/tp] with BTP's sharded one."""
    import torch

    d = cfg.model.hidden_size
    d_local = d // ctx.tp_pg.size() if model.strategy.residual_sharded else d
    g = torch.Generator().manual_seed(cfg.general.seed + 1)
    x = torch.randn(micro_batch, cfg.tokens.sequence_length, d_local, generator=g)
    return x.to(ctx.device).requires_grad_(True)


def block_comm(cfg: Any, model: Any, ctx: Any, micro_batch: int) -> Dict[str, Any]:
    """TP bytes and calls of ONE decoder block, forward and backward measured separately (the
    first local block, fed a [b, s, d_local] input), with the ledger's per-op breakdown."""
    import torch

    from nanotron_ext.parallel.comm import get_ledger

    ledger = get_ledger()
    block = first_local_block(model)
    x = block_input(cfg, model, ctx, micro_batch)
    out: Dict[str, Any] = {}
    with autocast_for(cfg, ctx.device):
        ledger.reset()
        y = block(hidden_states=x)["hidden_states"]
        out["fwd"] = {"bytes": ledger.bytes(group="tp"), "calls": ledger.calls(group="tp"),
                      "ops": ledger.snapshot().get("tp", {})}
    ledger.reset()
    y.backward(torch.ones_like(y))
    out["bwd"] = {"bytes": ledger.bytes(group="tp"), "calls": ledger.calls(group="tp"),
                  "ops": ledger.snapshot().get("tp", {})}
    model.zero_grad(set_to_none=True)
    ledger.reset()
    return out


def comm_seconds(prof: Any) -> float:
    """Time spent in collectives in a torch.profiler trace: NCCL kernel time on GPU, the gloo
    collective events' wall time on CPU (both include waiting for the slowest peer)."""
    total_us = 0.0
    for e in prof.events():
        name = e.name.lower()
        if "nccl" in name and getattr(e, "device_time_total", 0):
            total_us += e.device_time_total if e.device_type.name == "CUDA" else 0.0
        elif name.startswith("gloo:"):
            total_us += e.cpu_time_total
    return total_us * 1e-6


@contextlib.contextmanager
def profiler_for(device: Any, memory: bool = False) -> Iterator[Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if getattr(device, "type", "cpu") == "cuda" else [])
    with profile(activities=acts, profile_memory=memory) as prof:
        yield prof


def allocator_net_bytes(prof: Any, device: Any) -> int:
    """Bytes allocated minus bytes freed inside a profiled region (what the region leaves held)."""
    if getattr(device, "type", "cpu") == "cuda":
        return int(sum(getattr(e, "self_device_memory_usage", 0) for e in prof.events()))
    return int(sum(e.self_cpu_memory_usage for e in prof.events()))


class SavedTensorBytes:
    """Bytes of distinct storages saved for backward while active (saved_tensors_hooks), parameters
    and buffers excluded; also counts tensors that torch.utils.checkpoint frames keep as re-forward
    inputs, which the hook does not see when they are passed inside dicts."""

    def __init__(self, model: Any) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.storages: Dict[Tuple[str, int], int] = {}
        self._stack = contextlib.ExitStack()

    def _note(self, t: Any) -> None:
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

    def __enter__(self) -> "SavedTensorBytes":
        import torch

        from nanotron_ext.boost import lowrank

        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        # the low-rank checkpoint regions call torch.utils.checkpoint.checkpoint through the name
        # lowrank.checkpoint: wrap it (this process only) to see the inputs each frame keeps
        original = getattr(lowrank, "checkpoint", None)
        if original is not None:
            def counting_checkpoint(fn: Callable, *args: Any, **kwargs: Any) -> Any:
                self._note(list(args))
                self._note(dict((k, v) for k, v in kwargs.items() if k != "use_reentrant"))
                return original(fn, *args, **kwargs)

            lowrank.checkpoint = counting_checkpoint
            self._stack.callback(setattr, lowrank, "checkpoint", original)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def persistent_bytes(model: Any, optimizer: Any) -> Dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (tied parameters counted once)."""
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
    from nanotron_ext.metrics.memory import peak_memory_bytes

    return int(peak_memory_bytes())


def reset_peak(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gather_to_main(value: Any) -> List[Any]:
    """All ranks' picklable `value`s on every rank (only small result dicts go through this)."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [value]
    out: List[Any] = [None] * td.get_world_size()
    td.all_gather_object(out, value)
    return out


def write_worker_result(path: Optional[str], payload: Dict[str, Any]) -> None:
    if path and is_main():
        write_rows(path, payload.get("rows", []), payload.get("meta"))


def read_result(path: Path) -> Dict[str, Any]:
    return json.loads(Path(path).read_text())


def common_worker_meta(cfg: Any, ctx: Any) -> Dict[str, Any]:
    import torch

    return run_meta({
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "dp": ctx.dp_pg.size(), "tp": ctx.tp_pg.size(), "pp": ctx.pp_pg.size(),
        "device": str(ctx.device), "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
    })


# ================================================================================================
# one-job benchmarks (tables 3-5, figures): shared orchestration
# ================================================================================================
def add_run_args(parser: Any, iters: int, warmup: int) -> None:
    """Options every one-job benchmark shares, and the hidden worker-side ones."""
    parser.add_argument("--iters", type=int, default=iters, help=f"timed iterations per variant (default {iters})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"leading iterations dropped (default {warmup})")
    parser.add_argument("--out", help="also write the table as JSON (or CSV for a .csv name)")
    parser.add_argument("--log-dir", help="keep resolved configs, the worker log and raw JSON here (default: temp dir)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the torchrun job")
    parser.add_argument("--verbose", action="store_true", help="stream worker output")
    parser.add_argument("--worker", action="store_true", help=argparse_suppress())
    parser.add_argument("--configs", nargs="+", help=argparse_suppress())
    parser.add_argument("--names", nargs="+", help=argparse_suppress())
    parser.add_argument("--result-file", help=argparse_suppress())


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def run_job(script: str | Path, named_cfgs: Dict[str, Any], worker_args: Sequence[str], torchrun_args: Sequence[str],
            log_dir: Optional[str], timeout_s: float, verbose: bool) -> Dict[str, Any]:
    """Save each config, run ONE torchrun job of `script --worker` over all of them, return its JSON."""
    from nanotron_ext.config.loader import save_config

    work = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}_"))
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (name, cfg) in enumerate(named_cfgs.items()):
        path = work / f"config_{i}.yaml"
        save_config(cfg, path)
        paths.append(str(path))
    result = work / "result.json"
    args = ["--worker", "--configs", *paths, "--names", *named_cfgs.keys(), "--result-file", str(result), *worker_args]
    rc, tail = launch(script, args, torchrun_args, work / "log.txt", timeout_s, verbose)
    if rc != 0 or not result.exists():
        raise SystemExit(f"{Path(script).name}: the torchrun job failed (rc={rc}): {last_error_line(tail)}\n"
                         f"log: {work / 'log.txt'}\n{tail}")
    return read_result(result)


def require_strategies(needed: Sequence[str]) -> List[str]:
    """The subset of `needed` that is registered; prints why the others are missing."""
    registered, why = available_strategies()
    missing = [s for s in needed if s not in registered]
    for s in missing:
        print(f"{s}: not available (tp_strategy not registered{'; ' + why if why else ''})", file=sys.stderr)
    return [s for s in needed if s in registered]


def worker_configs(args: Any) -> Tuple[List[str], List[Any], Any]:
    """(names, configs, ParallelContext) on a worker; every config shares the first one's layout."""
    from nanotron_ext.config.loader import load_config

    cfgs = [load_config(p) for p in args.configs]
    ctx = init_distributed(cfgs[0])
    for cfg in cfgs:
        adapt_layout(cfg, ctx.world_pg.size())
    return list(args.names or args.configs), cfgs, ctx


def activation_bytes(model: Any, forward: Callable[[], Any], device: Any) -> Tuple[Any, Dict[str, int]]:
    """Run `forward` (returns a loss); measure what it leaves held for backward two ways:
    allocator net bytes (profile_memory) and saved-for-backward bytes (hooks + checkpoint inputs).
    Returns (loss, {"allocator": .., "saved": ..}); call loss.backward() afterwards."""
    with SavedTensorBytes(model) as saved, profiler_for(device, memory=True) as prof:
        loss = forward()
    return loss, {"allocator": allocator_net_bytes(prof, device), "saved": saved.bytes}


# ================================================================================================
# figures
# ================================================================================================
def figure_title(what: str, meta: Dict[str, Any]) -> str:
    """Every figure says what produced it: device and date."""
    return f"{what}\n{meta.get('machine', machine_label())}, {str(meta.get('date', ''))[:10]}"


def save_figure(fig: Any, png: str | Path, rows: Sequence[Dict[str, Any]], meta: Dict[str, Any]) -> Tuple[Path, Path]:
    """PNG plus the JSON of the plotted numbers beside it (same stem)."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return png, write_rows(png.with_suffix(".json"), rows, meta)


# one colour per compared design in every figure
DESIGN_COLORS = {"megatron": "tab:blue", "full": "tab:blue", "vanilla": "tab:orange", "btp": "tab:green",
                 "boost": "tab:green", "online": "tab:green", "sync": "tab:red"}


def design_color(label: str) -> Optional[str]:
    low = label.lower()
    for key in ("sync", "online", "btp", "boost", "vanilla", "megatron", "full"):
        if key in low:
            return DESIGN_COLORS[key]
    return None


def grouped_bars(ax: Any, groups: Sequence[str], series: Dict[str, Sequence[Optional[float]]],
                 errors: Optional[Dict[str, Sequence[Optional[float]]]] = None, ylabel: str = "") -> None:
    """Side-by-side bars: one cluster per group, one bar per series (None = not measured)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        vals = [float("nan") if v is None else v for v in values]
        err = None
        if errors and label in errors:
            err = [0.0 if e is None else e for e in errors[label]]
        ax.bar(xs, vals, width, yerr=err, label=label, capsize=2, color=design_color(label))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
