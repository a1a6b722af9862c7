"""DP-tier link: a gloo all-reduce between two ranks over a real shaped link (netns + tc tbf) against the
emulated DP tier (parallelism.link.dp: the ring closed form slept before the call, parallel/link.py).

    sudo .venv/bin/python benchmarks/link_emulation_dp.py --compare --rate-mbps 80    # the table (root)
    .venv/bin/python benchmarks/link_emulation_dp.py --local --emulate-mbps 80        # emulated only

Both ranks all-reduce `--mib` MiB of fp32 `--count` times back to back; time per all-reduce = rank 0's
median over `--repeats` runs. A 2-rank ring all-reduce of N bytes sends N/2 twice each way: N * 8 / B
seconds on a full-duplex link of B bit/s, which is what the emulator sleeps and what a tbf-shaped veth
lets through. The companion of benchmarks/link_emulation.py (pipeline tier); the target is agreement within 15%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from nanotron_ext.cli_flags import one_line_refusals

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from nanotron_ext.cli_flags import Float, Int, Parser

    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="spawn both ranks on loopback (torchrun)")
    mode.add_argument("--compare", action="store_true", help="shaped vs emulated table (root for netns)")
    p.add_argument("--emulate-mbps", type=Float(0.0), default=0.0,
                   help="DP tier bandwidth in Mbit/s (0 = not emulated)")
    p.add_argument("--rate-mbps", type=Float(0.0, low_open=True), default=80.0,
                   help="--compare: shaped and emulated rate")
    p.add_argument("--mib", type=Float(0.0, low_open=True), default=2.0, help="all-reduce size in MiB")
    p.add_argument("--count", type=Int(1), default=3, help="all-reduces per timed run")
    p.add_argument("--repeats", type=Int(1), default=3, help="timed runs; the median is reported")
    return p.parse_args(argv)


def run_rank(args: argparse.Namespace) -> None:
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.config.schema import DpLinkConfig, LinkConfig
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.link import install_collective_links

    torch.set_num_threads(1)
    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo", timeout_s=120.0)
    if args.emulate_mbps > 0:
        install_collective_links(LinkConfig(enabled=True, dp=DpLinkConfig(bandwidth_mbps=args.emulate_mbps)),
                                 get_ledger().group_name)
    x = torch.ones(int(args.mib * 2**20) // 4)
    dist.all_reduce(x, group=ctx.dp_pg)  # warm-up: connections, the tbf bucket's initial burst
    times = []
    for _ in range(args.repeats):
        dist.barrier(ctx.dp_pg)
        t0 = time.time()
        for _ in range(args.count):
            dist.all_reduce(x, group=ctx.dp_pg)
        times.append((time.time() - t0) / args.count)
    if dist.get_rank(ctx.dp_pg) == 0:
        nbytes = x.numel() * 4
        median = statistics.median(times)
        print("RESULT " + json.dumps({"bytes": nbytes, "s_per_allreduce": median, "runs": times,
                                      "goodput_mbps": nbytes * 8 / median / 1e6,
                                      "netns": os.environ.get("NTX_NETNS", ""), "emulate_mbps": args.emulate_mbps}),
              flush=True)


def _result(cmd: List[str]) -> dict:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"no RESULT from {' '.join(cmd)} (rc {proc.returncode}):\n{proc.stderr[-2000:]}")


def _worker_args(args: argparse.Namespace, emulate: float) -> List[str]:
    return [str(Path(__file__).resolve()), "--emulate-mbps", str(emulate), "--mib", str(args.mib),
            "--count", str(args.count), "--repeats", str(args.repeats)]


def local(args: argparse.Namespace, emulate: float) -> dict:
    return _result([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    *_worker_args(args, emulate)])


def compare(args: argparse.Namespace) -> int:
    rate = args.rate_mbps
    shaped = _result(["bash", str(REPO / "scripts" / "netns_pipeline.sh"), "--rate", f"{rate * 1000:g}kbit", "--",
                      sys.executable, *_worker_args(args, 0.0)])
    emulated = local(args, rate)
    closed = shaped["bytes"] * 8 / (rate * 1e6)
    ratio = emulated["s_per_allreduce"] / shaped["s_per_allreduce"]
    print(f"2-rank all-reduce of {shaped['bytes'] / 2**20:g} MiB at {rate:g} Mbit/s (closed form {closed:.3f} s):")
    print(f"  shaped (netns + tc tbf): {shaped['s_per_allreduce']:.3f} s  ({shaped['goodput_mbps']:.1f} Mbit/s)")
    print(f"  emulated DP tier       : {emulated['s_per_allreduce']:.3f} s  ({emulated['goodput_mbps']:.1f} Mbit/s)")
    print(f"  emulated / shaped = {ratio:.3f} ({'within' if abs(ratio - 1) <= TOLERANCE else 'OUTSIDE'} "
          f"{TOLERANCE:.0%})")
    print("RESULT " + json.dumps({"rate_mbps": rate, "closed_form_s": closed, "shaped": shaped, "emulated": emulated,
                                  "ratio": ratio}))
    return 0 if abs(ratio - 1) <= TOLERANCE else 1


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    if args.local:
        print(json.dumps(local(args, args.emulate_mbps)))
        return 0
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
