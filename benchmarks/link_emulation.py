"""Pipeline-link goodput: a real shaped link (netns + tbf) against the LinkEmulator.

Three ways to run it:

  # one rank of the 2-rank benchmark (env from torchrun or scripts/netns_pipeline.sh)
  sudo scripts/netns_pipeline.sh --rate 80mbit -- .venv/bin/python benchmarks/link_emulation.py
  # both ranks on plain loopback, optionally through an emulated link (0 = unlimited)
  .venv/bin/python benchmarks/link_emulation.py --local --emulate-mbps 80
  # the comparison table: real shaped / emulated / unshaped / emulated-unlimited (root for netns)
  sudo .venv/bin/python benchmarks/link_emulation.py --compare

Rank 0 sends `--count` tensors of pipeline-activation size (micro-batch x seq x hidden, fp32)
back to back through AccountedP2P; rank 1 receives them. Goodput = payload bits (the ledger's
`recv:fwd` bytes) / time from rank 0's first send to rank 1's last receive. Both ranks are on this
host, also in separate network namespaces, so their wall clocks are the same clock. Rank 1 prints
one `RESULT {json}` line: per variant, every run and the median and best goodput.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from nanotron_ext.cli_flags import one_line_refusals

REPO = Path(__file__).resolve().parents[1]
NETNS_SCRIPT = REPO / "scripts" / "netns_pipeline.sh"
TOLERANCE = 0.15  # the agreement target between emulated and really shaped goodput


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from nanotron_ext.cli_flags import Float, Int, NumberList, Parser, Text

    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="spawn both ranks on loopback")
    mode.add_argument("--compare", action="store_true", help="run the shaped/emulated comparison table")
    p.add_argument("--emulate-mbps", default="none", type=NumberList(0, integer=False, words=("none",)),
                   help="send through a LinkEmulator of this bandwidth in Mbit/s (0 = unlimited; 'none' = no "
                        "emulator); a comma list (e.g. 0,none) alternates the variants run by run, so they "
                        "share whatever load the machine has")
    p.add_argument("--latency-ms", type=Float(0.0), default=0.0, help="emulated one-way latency")
    p.add_argument("--micro-batch", type=Int(1), default=1)
    p.add_argument("--seq", type=Int(1), default=256)
    p.add_argument("--hidden", type=Int(1), default=1024)
    p.add_argument("--count", type=Int(1), default=8, help="tensors per timed run (sent back to back)")
    p.add_argument("--repeats", type=Int(1), default=3, help="timed runs; the median is reported")
    p.add_argument("--label", default="", type=Text(empty=True), help="free text copied into the RESULT line")
    p.add_argument("--rate-mbps", type=Float(0.0, low_open=True), default=80.0,
                   help="--compare: shaped and emulated rate")
    p.add_argument("--unshaped-count", type=Int(1), default=32, help="--compare: tensors per run without a rate limit")
    p.add_argument("--unshaped-repeats", type=Int(1), default=7, help="--compare: runs without a rate limit")
    return p.parse_args(argv)


# -- one rank ----------------------------------------------------------------------------------------
def _variants(spec: str) -> List[Optional[float]]:
    return [None if v.strip().lower() == "none" else float(v) for v in spec.split(",")]


def _variant_name(mbps: Optional[float]) -> str:
    return "none" if mbps is None else f"{mbps:g}"


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as torch_dist

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.link import LinkEmulator, LinkSpec
    from nanotron_ext.parallel.p2p import AccountedP2P

    torch.set_num_threads(1)
    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo", timeout_s=60.0)
    variants = _variants(args.emulate_mbps)
    p2ps = {
        _variant_name(mbps): AccountedP2P(
            ctx.pp_pg, torch.device("cpu"), link=None if mbps is None else LinkEmulator(LinkSpec(mbps, args.latency_ms))
        )
        for mbps in variants
    }
    rank = torch_dist.get_rank(ctx.pp_pg)
    ledger = get_ledger()
    activation = torch.randn(args.micro_batch, args.seq, args.hidden, dtype=torch.float32)

    def one_run(p2p: AccountedP2P, count: int) -> Optional[Dict[str, float]]:
        torch_dist.barrier(ctx.pp_pg)
        before = ledger.bytes("pp", "recv:fwd")
        t0 = time.time()
        for _ in range(count):
            if rank == 0:
                p2p.send_tensors([activation], to_rank=1)
            else:
                p2p.recv_tensors(1, from_rank=0)
        t1 = time.time()
        # rank 0's start time, sent after the clock stopped (plain gloo, outside the ledger and link)
        start = torch.tensor([t0], dtype=torch.float64)
        if rank == 0:
            torch_dist.send(start, dst=torch_dist.get_global_rank(ctx.pp_pg, 1), group=ctx.pp_pg)
            return None
        torch_dist.recv(start, src=torch_dist.get_global_rank(ctx.pp_pg, 0), group=ctx.pp_pg)
        payload = ledger.bytes("pp", "recv:fwd") - before
        elapsed = t1 - float(start.item())
        return {"payload_bytes": payload, "elapsed_s": elapsed, "goodput_mbps": payload * 8 / elapsed / 1e6}

    for p2p in p2ps.values():
        one_run(p2p, 2)  # warm-up: connections, allocator, TCP window, the tbf bucket's initial burst
    runs: Dict[str, list] = {name: [] for name in p2ps}
    for _ in range(args.repeats):
        for name, p2p in p2ps.items():  # interleaved: every variant sees the same background load
            runs[name].append(one_run(p2p, args.count))
    if rank == 1:
        per_variant = {
            name: {
                "goodput_mbps": statistics.median(r["goodput_mbps"] for r in rs),
                "best_mbps": max(r["goodput_mbps"] for r in rs),
                "runs": rs,
            }
            for name, rs in runs.items()
        }
        result = {
            "label": args.label,
            "netns": os.environ.get("NTX_NETNS", ""),
            "shaped_rate": os.environ.get("NTX_RATE", ""),
            "tensor_bytes": activation.numel() * activation.element_size(),
            "count": args.count,
            "variants": per_variant,
        }
        print("RESULT " + json.dumps(result), flush=True)
    torch_dist.barrier(ctx.pp_pg)


# -- launchers -----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_argv(args: argparse.Namespace, *, variants: str, count: int, repeats: int, label: str) -> List[str]:
    return [sys.executable, str(Path(__file__).resolve()),
            "--micro-batch", str(args.micro_batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
            "--count", str(count), "--repeats", str(repeats), "--label", label,
            "--latency-ms", str(args.latency_ms), "--emulate-mbps", variants]


def _parse_result(stdout: str) -> Dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line in output:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def launch_local(rank_argv: List[str], timeout_s: float = 120.0) -> Dict:
    """Both ranks on this host's loopback; returns rank 1's result."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(rank_argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(o[-2000:] for o in outs))
    return _parse_result(outs[1])


def launch_netns(rank_argv: List[str], rate: Optional[str], mtu: int = 1500, timeout_s: float = 120.0) -> Dict:
    """Rank 0 and rank 1 in two namespaces joined by a veth (shaped with tbf at `rate` if given)."""
    cmd = [str(NETNS_SCRIPT), "--mtu", str(mtu)] + (["--rate", rate] if rate else []) + ["--"] + rank_argv
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}")
    return _parse_result(out.stdout)


def run_local(args: argparse.Namespace) -> None:
    argv = _rank_argv(args, variants=args.emulate_mbps, count=args.count, repeats=args.repeats, label="local")
    print(json.dumps(launch_local(argv), indent=1))


# -- the comparison ------------------------------------------------------------------------------------
def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * b


def compare(args: argparse.Namespace) -> int:
    rate = args.rate_mbps
    tc_rate = f"{rate:g}mbit"
    can_netns = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
    rated = dict(count=args.count, repeats=args.repeats)
    unshaped = dict(count=args.unshaped_count, repeats=args.unshaped_repeats)
    # case -> (description, launcher); each launcher returns rank 1's per-variant results
    launches = {
        "a": (f"netns veth + tbf {tc_rate}", lambda: launch_netns(
            _rank_argv(args, variants="none", label="shaped", **rated), tc_rate)),
        "b": (f"loopback + emulator {rate:g} Mbit/s", lambda: launch_local(
            _rank_argv(args, variants=f"{rate:g}", label="emulated", **rated))),
        # MTU as lo's, so (c) and (d) differ in the device, not in the packet size
        "c": ("netns veth (MTU 65535), unshaped", lambda: launch_netns(
            _rank_argv(args, variants="none", label="unshaped", **unshaped), None, mtu=65535)),
        # (d) and (e) in one pair of processes, alternating run by run, so they share the load
        "de": ("loopback, emulator unlimited / no emulator, alternating", lambda: launch_local(
            _rank_argv(args, variants="0,none", label="loopback", **unshaped))),
    }
    tensor_mb = args.micro_batch * args.seq * args.hidden * 4 / 1e6
    print(f"activation tensor {args.micro_batch}x{args.seq}x{args.hidden} fp32 = {tensor_mb:.2f} MB; "
          f"{args.count} back to back per run at {rate:g} Mbit/s (median of {args.repeats} runs), "
          f"{args.unshaped_count} per run unshaped (best of {args.unshaped_repeats}); "
          f"agreement target {TOLERANCE:.0%}", flush=True)
    variants: Dict[str, Dict] = {}
    started = time.time()
    for key, (what, launch) in launches.items():
        if key in "ac" and not can_netns:
            print(f"  ({key}) {what}: skipped (needs root, ip and tc)", flush=True)
            continue
        t = time.time()
        res = launch()["variants"]
        for name, v in res.items():
            sub = key if len(key) == 1 else {"0": "d", "none": "e"}[name]
            variants[sub] = v
            runs = ", ".join(f"{r['goodput_mbps']:.0f}" for r in v["runs"])
            print(f"  ({sub}) {what} [{name}]: median {v['goodput_mbps']:.1f}, best {v['best_mbps']:.1f} Mbit/s "
                  f"(runs: {runs})", flush=True)
        print(f"      {time.time() - t:.1f}s", flush=True)

    # at a rate limit the median is stable to <1%; unshaped, the runs swing several-fold with the
    # other jobs on the 2 cores, so the path's capacity is its best run
    stat = {"a": "goodput_mbps", "b": "goodput_mbps", "c": "best_mbps", "d": "best_mbps", "e": "best_mbps"}
    value = {k: (variants[k][stat[k]] if k in variants else None) for k in stat}

    # (d) vs (e): the median over alternating run pairs of (d)/(e); neighbours share the load
    paired = None
    if "d" in variants and "e" in variants:
        paired = statistics.median(
            d["goodput_mbps"] / e["goodput_mbps"] for d, e in zip(variants["d"]["runs"], variants["e"]["runs"])
        )

    def row(mode: str, rate_s: str, key: str, vs: Optional[str], note: str = "",
            ratio_v: Optional[float] = None) -> str:
        g, ref = value[key], (value[vs] if vs else None)
        ratio = verdict = "-"
        if g is not None and ref is not None:
            ratio_v = g / ref if ratio_v is None else ratio_v
            ratio, verdict = f"{ratio_v:.3f}", ("PASS" if abs(ratio_v - 1) <= TOLERANCE else "FAIL") + note
        gs = "skipped" if g is None else f"{g:.1f}"
        return f"| {mode:<36} | {rate_s:>8} | {gs:>8} | {ratio:>6} | {verdict:<27} |"

    print()
    print(f"| {'mode':<36} | {'rate':>8} | {'Mbit/s':>8} | {'ratio':>6} | {'within 15%':<27} |")
    print(f"|{'-' * 38}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 29}|")
    print(row("(a) real: netns veth + tbf", tc_rate, "a", None))
    print(row("(b) emulated on loopback", f"{rate:g}mbit", "b", "a"))
    print(row("(c) real: netns veth, unshaped", "none", "c", None))
    print(row("(d) emulated unlimited on loopback", "unl.", "d", "c", " (ill-posed, see below)"))
    print(row("(e) loopback, no emulator", "none", "e", None))
    print(row("(d)/(e): unlimited emulator overhead", "unl.", "d", "e", ratio_v=paired))
    print()
    print("ratio: (b)/(a) of medians; (d)/(c) of best runs; (d)/(e) median of run-by-run ratios. "
          "Rated rows show the median goodput, unshaped rows the best run. Exit status: (b)/(a) only.")
    if value["a"] is not None:
        wire = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (with timestamps); tbf meters frames
        print(f"(b) vs (a): the emulator meters payload bytes, tbf meters whole Ethernet frames, so the real "
              f"link carries at most ~{rate * wire:.1f} Mbit/s of payload: {1 / wire - 1:.1%} of (b)/(a) is "
              f"header overhead; any rest is gloo's per-message handshakes.")
    print("(d) vs (c) is ill-posed: with no rate limit neither side models a link. (c) is the kernel copying "
          "through a veth pair between namespaces, (d) through lo, both sharing 2 cores with gloo's own "
          "copies and with whatever else runs, so the ratio compares two memory paths under load, not the "
          "emulator. What an unlimited emulated link must get right is to add little to the transport it "
          "rides on: (d)/(e), measured in one process pair with the two variants alternating run by run. "
          "Its cost is one extra 8-byte gloo message (the arrival clock) per pipeline message: a fixed "
          "small-message hop (0.1-0.3 ms on this shared 2-core machine, load dependent), up to ~20% of a "
          "1 MB message moving at 6-9 Gbit/s but under 0.3% of one at 80 Mbit/s (105 ms).")
    print(f"total {time.time() - started:.0f}s")
    return 0 if value["a"] is not None and value["b"] is not None and _agree(value["b"], value["a"]) else 1


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    if args.local:
        run_local(args)
        return 0
    if "RANK" not in os.environ:
        print("link_emulation: no RANK in the environment; use --local, --compare, torchrun or "
              "scripts/netns_pipeline.sh", file=sys.stderr)
        return 2
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
