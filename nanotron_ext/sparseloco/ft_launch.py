"""One-machine launcher for fault-tolerant SparseLoCo (sparseloco.fault_tolerance; docs/techniques/sparseloco.md):
a torchft lighthouse in this process at sparseloco.fault_tolerance.lighthouse's port, and one training job per
replica (`python -m nanotron_ext.launch ... --set sparseloco.fault_tolerance.replica=R`, run `<general.run>_rR`,
checkpoints `<checkpoints.dir>_rR`), each in its own process group so it can be killed alone. A replica that dies
(killed, crashed) is started again up to --max-restarts times; it rejoins at the others' next sync.

    python -m nanotron_ext.sparseloco.ft_launch --nproc_per_node=1 --config-file examples/config_tiny_sparseloco_ft.yaml

Over several hosts each host runs its own replicas (`--replicas R ...`), the host whose address the lighthouse URL
names serves it and the others launch with `--no-lighthouse`; every host gives the same
`--set sparseloco.fault_tolerance.lighthouse=http://HOST0:29510` (docs/running.md#many-hosts).

Exit codes: 0 every replica finished, 2 a bad config (one line), 1 a replica failed past its restarts, 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Dict, List, Optional


def replica_command(args: argparse.Namespace, replica: int, run: str, ckpt_dir: str) -> List[str]:
    sets = [f"sparseloco.fault_tolerance.replica={replica}", f"general.run={run}_r{replica}",
            f"checkpoints.dir={ckpt_dir}_r{replica}"]
    return [sys.executable, "-m", "nanotron_ext.launch", f"--nproc_per_node={args.nproc_per_node}",
            "-m", "nanotron_ext.train", "--config-file", args.config_file,
            *[x for s in args.set + sets for x in ("--set", s)]]


def serve_lighthouse(ft: object, join_timeout_ms: int) -> object:
    """A torchft lighthouse at the configured address only: on all interfaces any host could join the job as a
    replica (issue 33 row 14)."""
    from torchft.coordination import LighthouseServer

    from nanotron_ext.sparseloco.ft_peer import lighthouse_bind

    return LighthouseServer(bind=lighthouse_bind(ft.lighthouse), min_replicas=ft.min_replicas,
                            join_timeout_ms=join_timeout_ms)


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_flags import InputFile, Int, KeyValue, Parser

    # the numbers are checked when parsed, before the lighthouse starts: --join-timeout-ms -5 was torchft's
    # OverflowError traceback (a u64 of milliseconds there, so 2^64 too)
    parser = Parser(prog="python -m nanotron_ext.sparseloco.ft_launch", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", required=True, type=InputFile(format="yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                        help="config overrides, for all")
    parser.add_argument("--nproc_per_node", type=Int(1), default=1, help="processes per replica (its tp x pp)")
    parser.add_argument("--max-restarts", type=Int(0), default=3, help="restarts of each replica that dies")
    parser.add_argument("--join-timeout-ms", type=Int(0), default=60000,
                        help="how long a quorum waits for live replicas still in their inner loop")
    parser.add_argument("--replicas", type=Int(0), nargs="+", default=None, metavar="R",
                        help="the replicas this host runs (default: all of sparseloco.fault_tolerance.replicas); "
                        "over several hosts each host runs its own, one of them the lighthouse")
    parser.add_argument("--no-lighthouse", action="store_true",
                        help="another host serves the lighthouse at sparseloco.fault_tolerance.lighthouse")
    args = parser.parse_args(argv)

    from nanotron_ext.cli_checks import ArgumentError
    from nanotron_ext.config import ConfigError, load_config
    from nanotron_ext.errors import one_line

    try:
        cfg = load_config(args.config_file, overrides=args.set)
        ft = cfg.sparseloco.fault_tolerance
        if cfg.parallelism.dp_sync != "sparseloco" or not ft.enabled:
            raise ConfigError("sparseloco.fault_tolerance.enabled: this launcher runs fault-tolerant SparseLoCo; set "
                              "parallelism.dp_sync=sparseloco and sparseloco.fault_tolerance.enabled=true")
        mine = sorted(set(args.replicas if args.replicas is not None else range(ft.replicas)))
        if mine[-1] >= ft.replicas:
            raise ArgumentError(f"--replicas {mine[-1]}: the job has sparseloco.fault_tolerance.replicas="
                                f"{ft.replicas} (0..{ft.replicas - 1})")
    except (ArgumentError, ConfigError) as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    try:
        lighthouse = None if args.no_lighthouse else serve_lighthouse(ft, args.join_timeout_ms)
    except (OSError, RuntimeError) as e:
        print(f"error: sparseloco.fault_tolerance.lighthouse={ft.lighthouse}: cannot serve the lighthouse there "
              f"({one_line(str(e))}); on a host without that address launch with --no-lighthouse", file=sys.stderr)
        return 2
    where = f"lighthouse at {lighthouse.address()}" if lighthouse else f"lighthouse {ft.lighthouse} (another host's)"
    print(f"{where}; replicas {', '.join(map(str, mine))} of {ft.replicas} here", flush=True)
    try:
        code = supervise(lambda r: replica_command(args, r, cfg.general.run, cfg.checkpoints.dir), mine,
                         args.max_restarts)
        if lighthouse is not None and len(mine) < ft.replicas:
            serve_while_heartbeats(ft.lighthouse)  # other hosts' replicas may still be training
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


def heartbeats(address: str) -> Optional[int]:
    """How many replicas heartbeat to the lighthouse at `address` now (its status page), None when unreadable."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=5) as r:
            page = r.read().decode(errors="replace")
    except OSError:
        return None
    m = re.search(r"\[(\d+) heartbeating\]", page)
    return int(m.group(1)) if m else None


def serve_while_heartbeats(address: str, quiet_s: float = 12.0, poll_s: float = 1.0) -> None:
    """Keep serving the lighthouse while any replica (another host's) heartbeats to it: one host's replicas finishing
    first must not take the lighthouse from the others (they would wait quorum_timeout_s and stop). Returns after
    `quiet_s` without a heartbeat (torchft expires one after 5 s), or when the status page cannot be read."""
    quiet_since, said = time.monotonic(), False
    while time.monotonic() - quiet_since < quiet_s:
        n = heartbeats(address)
        if n is None:
            return
        if n > 0:
            quiet_since = time.monotonic()
            if not said:
                print(f"lighthouse: {n} replica(s) of other hosts still training; serving until they finish",
                      flush=True)
                said = True
        time.sleep(poll_s)


def supervise(command: Callable[[int], List[str]], replicas: List[int], max_restarts: int) -> int:
    """Run each replica's job, restarting one that dies up to `max_restarts` times; 0 when all finished, 1 when one
    failed for good (or with a user-facing error, exit 2: the same on a restart). Stops them all on the way out."""
    procs: Dict[int, subprocess.Popen] = {}
    restarts = {r: 0 for r in replicas}

    def start(r: int) -> None:
        procs[r] = subprocess.Popen(command(r), start_new_session=True)  # its own group: kill -9 -<pid> kills it alone
        print(f"replica {r}: pid {procs[r].pid} (process group)", flush=True)

    try:
        for r in replicas:
            start(r)
        failed = False
        while procs:
            time.sleep(0.5)
            for r, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                del procs[r]
                if code == 0:
                    print(f"replica {r}: finished", flush=True)
                elif code == 2:  # a user-facing error: the same on a restart
                    failed = True
                elif restarts[r] < max_restarts:
                    restarts[r] += 1
                    print(f"replica {r}: exit code {code}; restart {restarts[r]} of {max_restarts}", flush=True)
                    start(r)
                else:
                    print(f"replica {r}: exit code {code}; no restarts left", flush=True)
                    failed = True
        return 1 if failed else 0
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)

if __name__ == "__main__":
    sys.exit(main())
