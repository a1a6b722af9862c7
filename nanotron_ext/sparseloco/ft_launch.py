"""One-machine launcher for fault-tolerant SparseLoCo (sparseloco.fault_tolerance; docs/techniques/sparseloco.md):
a torchft lighthouse in this process at sparseloco.fault_tolerance.lighthouse's port, and one training job per
replica (`python -m nanotron_ext.launch ... --set sparseloco.fault_tolerance.replica=R`, run `<general.run>_rR`,
checkpoints `<checkpoints.dir>_rR`), each in its own process group so it can be killed alone. A replica that dies
(killed, crashed) is started again up to --max-restarts times; it rejoins at the others' next sync.

    python -m nanotron_ext.sparseloco.ft_launch --nproc_per_node=1 --config-file examples/config_tiny_sparseloco_ft.yaml

Exit codes: 0 every replica finished, 2 a bad config (one line), 1 a replica failed past its restarts, 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional


def replica_command(args: argparse.Namespace, replica: int, run: str, ckpt_dir: str) -> List[str]:
    sets = [f"sparseloco.fault_tolerance.replica={replica}", f"general.run={run}_r{replica}",
            f"checkpoints.dir={ckpt_dir}_r{replica}"]
    return [sys.executable, "-m", "nanotron_ext.launch", f"--nproc_per_node={args.nproc_per_node}",
            "-m", "nanotron_ext.train", "--config-file", args.config_file,
            *[x for s in args.set + sets for x in ("--set", s)]]


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
    except (ArgumentError, ConfigError) as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    from torchft.coordination import LighthouseServer

    from nanotron_ext.sparseloco.ft_peer import lighthouse_bind

    try:  # the configured address only: on all interfaces any host could join the job as a replica (issue 33 row 14)
        lighthouse = LighthouseServer(bind=lighthouse_bind(ft.lighthouse), min_replicas=ft.min_replicas,
                                      join_timeout_ms=args.join_timeout_ms)
    except (OSError, RuntimeError) as e:
        print(f"error: sparseloco.fault_tolerance.lighthouse={ft.lighthouse}: cannot serve the lighthouse there: {e}",
              file=sys.stderr)
        return 2
    print(f"lighthouse at {lighthouse.address()}; {ft.replicas} replicas", flush=True)
    procs: Dict[int, subprocess.Popen] = {}
    restarts = {r: 0 for r in range(ft.replicas)}

    def start(r: int) -> None:
        procs[r] = subprocess.Popen(replica_command(args, r, cfg.general.run, cfg.checkpoints.dir),
                                    start_new_session=True)  # its own process group: kill -9 -<pid> kills it alone
        print(f"replica {r}: pid {procs[r].pid} (process group)", flush=True)

    try:
        for r in range(ft.replicas):
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
                elif restarts[r] < args.max_restarts:
                    restarts[r] += 1
                    print(f"replica {r}: exit code {code}; restart {restarts[r]} of {args.max_restarts}", flush=True)
                    start(r)
                else:
                    print(f"replica {r}: exit code {code}; no restarts left", flush=True)
                    failed = True
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        lighthouse.shutdown()


if __name__ == "__main__":
    sys.exit(main())
