"""`python -m nanotron_ext.bench.netns_hosts`: run a command on N hosts at once (the package docstring)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, List, Optional, Sequence, Tuple

from nanotron_ext.bench.netns_hosts import __doc__ as PACKAGE_DOC
from nanotron_ext.bench.netns_hosts.hosts import ROOT_REFUSAL, Hosts
from nanotron_ext.bench.netns_hosts.links import (
    MAX_HOSTS,
    HostsError,
    HostsUnavailable,
    available,
    delay_seconds,
    loss_percent,
    rate_bits_per_s,
)

# -- the command line -----------------------------------------------------------------------------------------------
PROG = "python -m nanotron_ext.bench.netns_hosts"
USAGE = (f"{PROG} --hosts N [--rate R] [--delay D] [--loss P] --disk-root DIR [--disk-at PATH] -- CMD [ARGS...]")


def build_parser() -> Any:
    from nanotron_ext.cli_flags import Int, OutputFolder, Parser, Text

    parser = Parser(prog=PROG, usage=USAGE, description=PACKAGE_DOC.split("\n\n")[0],
                    epilog="CMD runs on every host at once; {host} in it is the host's index, {addr0} host 0's "
                           "address. Exit code: the first failing host's (the others are stopped), else 0.")
    parser.add_argument("--hosts", type=Int(1, MAX_HOSTS), required=True, help="how many hosts")
    parser.add_argument("--rate", type=Text(), default=None, help="each host's link rate, as tc takes it (200mbit)")
    parser.add_argument("--delay", type=Text(), default=None,
                        help="one-way latency host to host (25ms): RTT = 2 x delay; needs netem")
    parser.add_argument("--loss", type=Text(), default=None, help="packet loss per trip (0.1%%); needs netem")
    parser.add_argument("--disk-root", type=OutputFolder(as_path=True), required=True,
                        help="host i's disk is DIR/host<i>")
    parser.add_argument("--disk-at", type=OutputFolder(as_path=True), default=None,
                        help="where each host's commands see their own disk")
    return parser


def _pump(stream: IO[bytes], out: IO[Any], prefix: bytes, lock: threading.Lock) -> None:
    """Copy `stream` to `out` line by line, each line prefixed (a last line without a newline gets one)."""
    sink = getattr(out, "buffer", None)
    for line in iter(stream.readline, b""):
        line = prefix + (line if line.endswith(b"\n") else line + b"\n")
        with lock:
            if sink is not None:
                sink.write(line)
            else:
                out.write(line.decode(errors="replace"))
            out.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as a shell says


def run_everywhere(hosts: Hosts, cmd: Sequence[str], stop_grace_s: float = 5.0) -> int:
    """Run `cmd` on every host at once, output prefixed `[host<i>] `; the first failing host's exit code (the others
    stopped: SIGTERM, then SIGKILL after `stop_grace_s`), 0 when all succeed."""
    locks = {id(sys.stdout): threading.Lock(), id(sys.stderr): threading.Lock()}
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    for i in range(hosts.n):
        argv = [a.replace("{host}", str(i)).replace("{addr0}", hosts.addr(0)) for a in cmd]
        proc = hosts.popen(i, argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[host{i}] ".encode(), locks[id(out)]), daemon=True)
            t.start()
            pumps.append(t)
    failed: Optional[Tuple[int, int]] = None
    running = set(range(hosts.n))
    while running and failed is None:
        for i in sorted(running):
            code = procs[i].poll()
            if code is not None:
                running.discard(i)
                if code != 0:
                    failed = (i, _exit_code(code))
                    break
        if running and failed is None:
            time.sleep(0.05)
    if failed is not None:
        print(f"netns_hosts: host{failed[0]} failed (exit {failed[1]}); stopping the others", file=sys.stderr,
              flush=True)
        for i in running:
            hosts.kill_host(i, signal.SIGTERM)
        deadline = time.monotonic() + stop_grace_s
        for i in running:
            try:
                procs[i].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hosts.kill_host(i)
    for t in pumps:  # a daemon left behind may hold a pipe open: clean-up kills it, the threads are daemons
        t.join(timeout=2.0)
    return failed[1] if failed is not None else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.cli_checks import ArgumentError
    from nanotron_ext.cli_flags import one_line_refusals
    from nanotron_ext.errors import one_line

    @one_line_refusals
    def checked_main(args_in: List[str]) -> int:
        # CMD is everything after the first `--`, split off before parsing: argparse would read its flags as ours
        flags, cmd = (args_in[:args_in.index("--")], args_in[args_in.index("--") + 1:]) if "--" in args_in \
            else (args_in, [])
        args = build_parser().parse_args(flags)
        for flag, value, check in (("--rate", args.rate, rate_bits_per_s), ("--delay", args.delay, delay_seconds),
                                   ("--loss", args.loss, loss_percent)):
            if value is not None:
                try:
                    check(value)
                except ValueError as e:
                    raise ArgumentError(f"{flag} {e}") from None
        if args.disk_at is not None and args.disk_at.resolve() == Path("/"):
            raise ArgumentError(f"--disk-at {args.disk_at}: {ROOT_REFUSAL}")
        if not cmd:
            raise ArgumentError(f"no command: give it after `--` ({USAGE})")
        reason = available(netem=bool(args.delay or args.loss))
        if reason is not None:
            raise HostsUnavailable(f"cannot make hosts here: {reason}")
        try:
            with Hosts(args.hosts, rate=args.rate, delay=args.delay, loss=args.loss, disk_root=args.disk_root,
                       disk_at=args.disk_at) as hosts:
                return run_everywhere(hosts, cmd)
        except KeyboardInterrupt:  # cleaned up already (the SIGINT handler), then the interrupt came through
            return 130
        except HostsError as e:  # the set-up failed (cleaned up): what the failing command said, one line
            print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
            return 1

    return checked_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
