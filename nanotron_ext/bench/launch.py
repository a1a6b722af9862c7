"""Launching: torchrun jobs of a script's worker role, and the worker-side set-up.

Orchestrator side: `split_argv` (script options before `--`, torchrun options after),
`torchrun_command`, `launch` (one job, output to a log, a timeout that kills only our own process
group), `run_job` (save each named config, run ONE job of `script --worker` over all of them, read
back its JSON). Worker side: `worker_configs` (load the configs, fit TP to the world size with
`adapt_layout`, the harness's one layout rule, announced on stderr; start the parallel context with
nanotron_ext.parallel.context.context_for), `gather_to_main`, `write_worker_result` (global rank 0 only).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench.report import SAVED_RESULT, checked_out, run_meta, write_rows
from nanotron_ext.cli_flags import Float, Int, OutputFolder
from nanotron_ext.config.loader import load_config, save_config

# torchrun arguments that mean "the user set up the rendezvous": then we do not add --standalone
_RDZV_FLAGS = ("--standalone", "--nnodes", "--rdzv", "--master", "--node", "--node_rank", "--node-rank")


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(script arguments, torchrun arguments): everything after the first `--` goes to torchrun."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def torchrun_command(torchrun_args: Sequence[str], script: str | Path, script_args: Sequence[str]) -> List[str]:
    """`python -m torch.distributed.run ...` with the running interpreter. Defaults to 2 local CPU
    processes and adds --standalone (a free rendezvous port, so concurrent runs on one host do not
    collide) unless the caller set up the rendezvous."""
    args = list(torchrun_args) or ["--nproc_per_node", "2"]
    if not any(a.split("=")[0].startswith(_RDZV_FLAGS) for a in args):
        args = ["--standalone"] + args
    return [sys.executable, "-m", "torch.distributed.run", *args, str(script), *script_args]


def launch(script: str | Path, worker_args: Sequence[str], torchrun_args: Sequence[str], log_path: Path,
           timeout_s: float, verbose: bool = False, env: Optional[Mapping[str, str]] = None) -> Tuple[int, str]:
    """Run one torchrun job; (return code, last lines of its output). Output goes to `log_path`
    (and the terminal with verbose); rc 124 after `timeout_s`. `env`: variables set for this job only (jobs
    launched from several threads at once cannot share os.environ edits)."""
    cmd = torchrun_command(torchrun_args, script, worker_args)
    env = {**os.environ, **(env or {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        # own session: on timeout we kill this job's process group and nothing else
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
            os.killpg(proc.pid, 15)
            proc.wait()
            rc = 124
            log.write(f"\n[timed out after {timeout_s:.0f}s]\n")
    lines = log_path.read_text().strip().splitlines()
    # our entry points print a user-facing failure as one "error: ..." line, above torchrun's banner
    errors = [ln for ln in lines if ln.startswith("error: ")][-1:]
    return rc, "\n".join(lines[-15:] + errors)


def last_error_line(tail: str) -> str:
    """The most informative line of a failed job's output (the exception message)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln[-300:]
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "error:", "Exception")) and not ln.startswith("File "):
            return ln[-200:]
    return lines[-1][-200:] if lines else "no output"


def read_result(path: str | Path) -> Dict[str, Any]:
    """A result JSON written by `write_rows` ({"meta", "rows", ...})."""
    return json.loads(Path(path).read_text())


def add_run_args(parser: argparse.ArgumentParser, iters: int, warmup: int, out: Optional[str] = None,
                 out_help: str = "also write the table: JSON (+ markdown beside it), or CSV for a .csv name",
                 worker: bool = True) -> None:
    """Options every script that launches torchrun jobs shares, --from-json, and (with `worker`, for a
    script that is its own torchrun worker) the hidden worker-side ones."""
    parser.add_argument("--iters", type=Int(1), default=iters,
                        help=f"timed iterations per variant (default {iters})")
    parser.add_argument("--warmup", type=Int(0), default=warmup, help=f"leading iterations dropped (default {warmup})")
    parser.add_argument("--out", default=out, type=checked_out, help=out_help)  # refused when parsed, not after
    parser.add_argument("--from-json", metavar="JSON", type=SAVED_RESULT,
                        help="measure nothing: re-render the table and paper column of a result this script wrote")
    parser.add_argument("--log-dir", type=OutputFolder(),
                        help="keep resolved configs, the worker log and raw JSON here (default: temp dir)")
    parser.add_argument("--timeout", type=Float(0, low_open=True), default=900, help="seconds for the torchrun job")
    parser.add_argument("--verbose", action="store_true", help="stream worker output")
    if worker:
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
        parser.add_argument("--names", nargs="+", help=argparse.SUPPRESS)
        parser.add_argument("--result-file", help=argparse.SUPPRESS)


def early_phase(args: argparse.Namespace, worker: Callable[[argparse.Namespace], Optional[Dict[str, Any]]],
                publish_saved: Callable[[Dict[str, Any]], int], check_iters: bool = True) -> Optional[int]:
    """The phases every one-job script shares before it launches anything: under torchrun (--worker) run
    `worker` and write what it returns (None: it wrote its own result); with --from-json re-render a saved
    result; otherwise check --iters > --warmup. Returns the exit code when the script is done, None when
    it should go on to launch the job."""
    if args.worker:
        result = worker(args)
        if result is not None:
            write_worker_result(args.result_file, result)
        return 0
    if args.from_json:  # one line for a file that is not a saved result (a FIFO blocked, /dev/zero read forever)
        from nanotron_ext.bench.report import read_saved

        return publish_saved(read_saved(args.from_json))
    if check_iters and args.iters <= args.warmup:  # (was exit code 1, without "error:")
        from nanotron_ext.cli_checks import refuse

        refuse(f"--iters {args.iters}: must exceed --warmup ({args.warmup})")
    return None


def run_job(script: str | Path, named_cfgs: Mapping[str, Any], worker_args: Sequence[str],
            torchrun_args: Sequence[str], log_dir: Optional[str], timeout_s: float, verbose: bool) -> Dict[str, Any]:
    """Save each config, run ONE torchrun job of `script --worker` over all of them, return its JSON."""
    work = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}_"))
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, cfg in enumerate(named_cfgs.values()):
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


# ------------------------------------------------------------------------------------------------
# worker side (under torchrun)
# ------------------------------------------------------------------------------------------------
def adapt_layout(cfg: Any, world_size: int) -> None:
    """The harness's one layout rule, so one config serves any --nproc_per_node: when dp * tp * pp does not
    match the world, TP fills it (tp = world / (dp * pp)), announced on stderr by rank 0. Then the layout is
    validated (shapes divisible by tp, ...) like any run's."""
    p = cfg.parallelism
    if p.dp * p.tp * p.pp != world_size:
        if world_size % (p.dp * p.pp):
            raise ValueError(f"world size {world_size} is not a multiple of dp*pp = {p.dp * p.pp}")
        if os.environ.get("RANK", "0") == "0":
            print(f"bench: parallelism.tp {p.tp} -> {world_size // (p.dp * p.pp)} to fill the {world_size} processes "
                  f"(dp={p.dp}, pp={p.pp}; nanotron_ext.bench.launch.adapt_layout)", file=sys.stderr)
        p.tp = world_size // (p.dp * p.pp)
    cfg.validate(world_size=world_size)


def init_distributed(cfg: Any) -> Any:
    """nanotron's ParallelContext for this config (tp adapted to the world size by `adapt_layout`), through
    the one public path, nanotron_ext.parallel.context.context_for."""
    # torch on the worker side only: orchestrators run without it
    from nanotron_ext.parallel.context import context_for

    world = int(os.environ.get("WORLD_SIZE", "1"))
    adapt_layout(cfg, world)
    return context_for(cfg, world_size=world)


def worker_configs(args: argparse.Namespace) -> Tuple[List[str], List[Any], Any]:
    """(names, configs, ParallelContext) on a worker; every config shares the first one's layout."""
    cfgs = [load_config(p) for p in args.configs]
    ctx = init_distributed(cfgs[0])
    for cfg in cfgs:
        adapt_layout(cfg, ctx.world_pg.size())
    return list(args.names or args.configs), cfgs, ctx


def is_main() -> bool:
    """Global rank 0 (or no process group)."""
    # torch on the worker side only: orchestrators run without it
    import torch.distributed as td

    return not td.is_initialized() or td.get_rank() == 0


def gather_to_main(value: Any) -> List[Any]:
    """All ranks' picklable `value`s on every rank (only small result dicts go through this)."""
    # torch on the worker side only: orchestrators run without it
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [value]
    out: List[Any] = [None] * td.get_world_size()
    td.all_gather_object(out, value)
    return out


def write_worker_result(path: Optional[str], payload: Dict[str, Any]) -> None:
    """Rank 0 writes {"meta", "rows"} for the orchestrator."""
    if path and is_main():
        write_rows(path, payload.get("rows", []), payload.get("meta"))


def worker_meta(ctx: Any) -> Dict[str, Any]:
    """run_meta plus the parallel layout, device, torch version and threads of this job."""
    # torch on the worker side only: orchestrators run without it
    import torch

    return run_meta({
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "dp": ctx.dp_pg.size(), "tp": ctx.tp_pg.size(), "pp": ctx.pp_pg.size(),
        "device": str(ctx.device), "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
    })
