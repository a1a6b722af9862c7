"""`python -m nanotron_ext.launch [torchrun options] -m nanotron_ext.train --config-file X.yaml [--set ...]`

torchrun (`torch.distributed.run`: the same options and defaults) that ends the way docs/failures.md promises: a
user-facing error is one line and exit code 2, not one line followed by torchrun's ~30-line ChildFailedError
report with a traceback of its own and exit 1. The workers hand their one-line errors over through torch
elastic's error files (`nanotron_ext.train.failures`); this launcher prints the first and exits with its code:

    0    the job finished                 2    a user-facing error (config, data, checkpoint, disk)
    1    a rank crashed or lost a peer    130  interrupted (Ctrl-C); 143 stopped by SIGTERM

Before any worker starts, the launcher runs the job's own start-up checks once (`nanotron_ext.train`'s
`preflight`: config, layout against the world size, output folders, prepared data, a resume with changed
settings): such an error is the same one line and exit 2 a second after the launch, with no worker started. An
elastic `--nnodes MIN:MAX` none of whose world sizes fits the layout is refused there too. Over several hosts
(a static rendezvous), the hosts' launchers agree on their checks before any of them waits in torch's rendezvous
(`nanotron_ext.launch_hosts`): one host's refusal is printed by every host, exit 2, and a rendezvous that cannot
form (node ranks swapped, duplicated, a host missing) is named within the rendezvous timeout. A host's own
checkpoints (checkpoints.storage=per_host) are left to the workers, which agree on them the same way.

No banner is printed (torchrun's OMP_NUM_THREADS notice and its per-worker shutdown warnings are silenced), and
`--shutdown-timeout` defaults to 10 s instead of 30 and also applies when a worker failed (torch waits a fixed
30 s there), so a frozen worker is killed 10 s after a peer reported it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, List, Optional, Tuple

from nanotron_ext.launch_hosts import agree, node_range, rendezvous, rendezvous_refusal

SHUTDOWN_TIMEOUT_S = 10


def _ours(failure: object) -> Optional[dict]:
    """Our part of a failed worker's error file ({"exitcode", "time", "rank"}), or None."""
    data = getattr(failure, "error_file_data", None)
    return data.get("nanotron_ext") if isinstance(data, dict) else None


# How a worker ends when the launcher stops it because another one failed (or the user pressed Ctrl-C).
_STOPPED = (130, 143, -2, -15)


def _how(rank: int, failure: object) -> str:
    code = failure.exitcode
    if code in _STOPPED:
        return f"rank {rank} (pid {failure.pid}) was stopped"
    if code < 0:
        return f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
    return f"rank {rank} (pid {failure.pid}) exited with code {code}"


def verdict(failures: dict) -> Tuple[str, int]:
    """The one line to print and the exit code for a failed job, from torch elastic's {rank: ProcessFailure}.

    A user-facing error (exit code 2) wins over everything else: it is the cause, the others stopped because of
    it. Then the earliest line a worker reported; then how the ranks ended, those that failed first. Ranks that
    were only stopped (exit 130 or SIGTERM: the launcher stops the rest once one failed) are never the cause;
    when every rank was stopped, the job was interrupted (130, nothing to add to rank 0's line)."""
    causes = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED}
    if not causes:
        return "", 130
    reported = sorted((_ours(f)["time"], r, f) for r, f in causes.items() if _ours(f) is not None)
    for _, _r, f in reported:
        if f.exitcode == 2:
            return f.message, 2
    if reported:
        _, first, f = reported[0]
        line, code = f.message, f.exitcode
    else:
        first = min(causes, key=lambda r: (causes[r].timestamp, r))
        line, code = f"error: {_how(first, causes[first])} (its output is above)", causes[first].exitcode
    rest = [_how(r, f) for r, f in sorted(failures.items()) if r != first]
    return line + (f"; then {', '.join(rest)}" if rest else ""), code if code > 0 else 1


def _agent_class() -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """Stops the other workers after a failure with --shutdown-timeout's grace: torch's process context does it
        with `close()` and its fixed 30 s default (a frozen worker only dies by the SIGKILL after the grace)."""

        def _start_workers(self, worker_group: object) -> dict:
            ids = super()._start_workers(worker_group)
            close = self._pcontext.close
            self._pcontext.close = lambda death_sig=None, timeout=None: close(
                death_sig, self._shutdown_timeout if timeout is None else timeout)
            return ids

    return Agent


def _fixed_world(args: object) -> Optional[int]:
    """nproc_per_node x nnodes when both are fixed numbers, else None (auto / gpu / an elastic min:max range)."""
    nproc, nnodes = str(getattr(args, "nproc_per_node", "")), str(getattr(args, "nnodes", "1"))
    lo, _, hi = nnodes.partition(":")
    if not nproc.isdigit() or not lo.isdigit() or (hi and hi != lo):
        return None
    return int(nproc) * int(lo)


def elastic_refusal(args: object, cfg: Any) -> Optional[str]:
    """Why an elastic --nnodes MIN:MAX can never start `cfg`'s layout (no world size in the range fits it), else
    None (a fixed --nnodes is checked by the preflight itself; --nproc-per-node a word: not known here)."""
    from nanotron_ext.config.checks import ConfigError

    nproc, (lo, hi) = str(getattr(args, "nproc_per_node", "")), node_range(args)
    if not nproc.isdigit() or lo == hi:
        return None
    worlds = [int(nproc) * n for n in range(lo, hi + 1)]
    for world in worlds:
        try:
            cfg.validate(world_size=world)
            return None
        except ConfigError:
            continue
    p = cfg.parallelism
    need = p.dp * p.tp * p.pp
    fix = (f"give a --nnodes range that holds {need // int(nproc)}" if need % int(nproc) == 0 else
           f"give --nproc-per-node and --nnodes whose product is {need}")
    return (f"--nnodes {args.nnodes}: with --nproc-per-node {nproc} the world is {worlds[0]} to {worlds[-1]} ranks, "
            f"and the layout needs {need} rank{'s' if need != 1 else ''} (parallelism.dp * tp * pp = {p.dp} * {p.tp} "
            f"* {p.pp}); {fix}")


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # what torchrun's --nproc_per_node takes besides a count


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (the same options and defaults) as one of ours: every error one line, exit code 2, and
    the numbers this launcher relies on checked when parsed (--nproc_per_node=-1 was an AssertionError traceback
    from torch elastic, `two` a ValueError traceback; --max-restarts -1, --master-port 70000 or a NaN
    --monitor-interval reached torch)."""
    from torch.distributed.run import get_args_parser

    from nanotron_ext.cli_flags import Float, Int, IntRange, OutputFolder, Parser

    torchrun = get_args_parser()
    parser = Parser(prog="python -m nanotron_ext.launch", description=torchrun.description, parents=[torchrun],
                    add_help=False, formatter_class=torchrun.formatter_class)
    types = {"nproc_per_node": Int(1, words=NPROC_WORDS), "nnodes": IntRange(1), "max_restarts": Int(0),
             "monitor_interval": Float(0.0, low_open=True), "node_rank": Int(0), "master_port": Int(0, 65535),
             "shutdown_timeout": Int(0), "log_dir": OutputFolder()}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to change an option's type
        if action.dest in types:
            action.type = types[action.dest]
    return parser


def check_world_args(args: object) -> None:
    """--nproc_per_node as torchrun reads it, checked before anything starts: a word it takes (gpu) on a machine
    without that device (the count and --nnodes were checked when parsed)."""
    from torch.distributed.run import determine_local_world_size

    from nanotron_ext.cli_checks import ArgumentError

    nproc = str(getattr(args, "nproc_per_node", "1"))
    try:
        determine_local_world_size(nproc)
    except ValueError as e:
        raise ArgumentError(f"--nproc_per_node {nproc}: cannot be used here ({e})") from None


def preflight_line(args: object) -> Optional[str]:
    """The one-line error of the job's start-up checks (nanotron_ext.train.preflight, and an elastic --nnodes range
    against the layout) when the launched module is our trainer and they fail, else None (another script, or
    nothing to refuse)."""
    if not (getattr(args, "module", False) and getattr(args, "training_script", None) == "nanotron_ext.train"):
        return None
    from nanotron_ext.errors import UserFacingError, one_line, os_error_line
    from nanotron_ext.train.__main__ import preflight

    try:
        cfg = preflight(list(args.training_script_args), _fixed_world(args), several_hosts=node_range(args)[1] > 1)
        refusal = elastic_refusal(args, cfg)
    except UserFacingError as e:
        return one_line(f"error: {e}")
    except OSError as e:  # a folder that cannot be created or read: as the worker reports it
        return one_line(f"error: {os_error_line(e)}")
    return one_line(f"error: {refusal}") if refusal else None


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api
    from torch.distributed.run import run

    from nanotron_ext.train.failures import LAUNCHER_ENV

    args = torchrun_parser().parse_args(argv)
    from nanotron_ext.cli_checks import ArgumentError
    from nanotron_ext.errors import one_line

    try:
        check_world_args(args)
        line = None
    except ArgumentError as e:
        line = f"error: {one_line(str(e))}"
    cannot_host = rendezvous_refusal(args)
    if cannot_host:  # node 0 that cannot host the rendezvous: there is nobody to tell
        print(f"error: {one_line(cannot_host)}", file=sys.stderr, flush=True)
        return 2
    line = line or preflight_line(args)
    agreed = None  # over several hosts: holds node 0's store, which torchrun's rendezvous reuses until run ends
    if rendezvous(args) is not None:
        try:
            agreed = agree(args, line, note=print)
        except KeyboardInterrupt:
            return 130
        if agreed.line and not agreed.printed:
            print(one_line(agreed.line), file=sys.stderr, flush=True)
        if agreed.line:
            return agreed.code
    elif line:
        print(line, file=sys.stderr, flush=True)
        return 2
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    for name in ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # our exit line replaces their reports
    os.environ[LAUNCHER_ENV] = "1"  # workers hand their errors to us instead of printing them
    launcher_api.LocalElasticAgent = _agent_class()  # what launch_agent builds (no parameter chooses the class)
    try:
        run(args)
    except ChildFailedError as e:
        line, code = verdict(e.failures)
        if line:  # (nothing to add when every rank was only stopped: rank 0 has printed where)
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:  # Ctrl-C or SIGTERM to the launcher: workers were stopped with the same signal
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
