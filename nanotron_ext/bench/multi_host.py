"""One training job across hosts that share no disk, on this machine: each host a network namespace with its own
shaped link and its own disk (bench/netns_hosts.py), one `python -m nanotron_ext.launch --nnodes N --node-rank i`
per host (torchrun's static rendezvous at host 0), checkpoints.storage=per_host.

    python -m nanotron_ext.bench.multi_host --mbps 20 --steps 20 --out reproduce/wan/results/real_network_2host.json

runs the 2-host pipeline example (a stage per host) over the shaped link, then the same config with the codec off,
and prints each one's measured step beside (a) the model clock's step for that link (bench/clock/replay.py: the run's
plan priced at its ranks' own CPU seconds, its messages over the link's rate; both overlap bounds) and (b) the same
job on one host through the real-sleep link emulator. The netem delay is not in this machine's kernel, so the link
has a rate and no added latency (the clock is given the same). tests/test_multi_host.py drives the same functions
for the multi-host checks (per-host checkpoints, a host killed, resume, export).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.bench.netns_hosts import Hosts, rate_bits_per_s
from nanotron_ext.bench.netns_hosts.links import MAX_RATE_BITS, MIN_RATE_BITS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "config_tiny_two_hosts.yaml"
PORT = 29500
CODECS = ("subspace", "identity")


class JobFailed(RuntimeError):
    """A run of the benchmark failed or outlived --timeout-s; the message is the one line to print."""


def launcher_argv(config: Path, node: int, nnodes: int, master: str, sets: Sequence[str], nproc: int = 1,
                  port: int = PORT) -> List[str]:
    """One host's launch of the trainer: its node rank and host 0's address (static rendezvous: a host keeps its
    node rank across relaunches, so its disk keeps holding its own ranks' shards)."""
    argv = [sys.executable, "-m", "nanotron_ext.launch", "--nnodes", str(nnodes), "--node-rank", str(node),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "static", "--master-addr", master,
            "--master-port", str(port), "-m", "nanotron_ext.train", "--config-file", str(config)]
    for s in sets:
        argv += ["--set", s]
    return argv


def disk_sets(disk_at: Path) -> List[str]:
    """Where every host's run writes: under the path each host sees as its own disk."""
    return [f"checkpoints.dir={disk_at}/checkpoints", f"general.output_dir={disk_at}/runs",
            "checkpoints.storage=per_host", "logging.progress_bar=false"]


def start_job(hosts: Hosts, config: Path, sets: Sequence[str], logs: Path) -> List[subprocess.Popen]:
    """Start the job on every host (each host's output in logs/host<i>.log); returns the launchers."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(hosts.n):
        out = open(logs / f"host{i}.log", "w")  # noqa: SIM115 - closed by wait_job
        # one thread per process: the hosts share this machine's cores (torchrun leaves OMP_NUM_THREADS unset for
        # one process per node, and two 2-thread ranks on 2 cores ran 8x slower than the same job on one host)
        argv = launcher_argv(config, i, hosts.n, hosts.addr(0), sets)
        procs.append(hosts.popen(i, argv, env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT,
                                 cwd=REPO))
        procs[-1].log = out  # type: ignore[attr-defined]
    return procs


def wait_job(procs: Sequence[subprocess.Popen], timeout_s: float) -> List[int]:
    """Every launcher's exit code (killed after `timeout_s`: its `timed_out` is then True)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.timed_out = True  # type: ignore[attr-defined]
            codes.append(p.wait())
        p.log.close()  # type: ignore[attr-defined]
    return codes


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def step_times(run_dir: Path) -> List[float]:
    from nanotron_ext.metrics.logger import read_metrics

    return [r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in r]


def clock_for(config: Path, sets: Sequence[str], run_dir: Path, mbps: float, cache: Path) -> Dict[str, Any]:
    """The model clock's step for this run over a link of `mbps` (no added latency), its compute priced at the
    run's ranks' mean CPU seconds per step (the first step excluded): over a plain pipe of that rate (a preset's
    link) and over the link as tc shapes it (tbf: its bucket passes a burst at line rate)."""
    from nanotron_ext.bench.clock import Link, bytes_per_step, planned, priced_at_cpu_seconds
    from nanotron_ext.bench.netns_hosts.links import tbf_burst_bytes
    from nanotron_ext.metrics.logger import read_metrics

    cpus = [r["rank_cpu_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "rank_cpu_s" in r][1:]
    rank_cpu = [statistics.fmean(c) for c in zip(*cpus)]
    free, plan = Link(0.0), planned(str(config), list(sets), cache)
    burst = tbf_burst_bytes(mbps * 1e6)
    bounds = {}
    for key, link in (("clock_step_s", Link(mbps)), ("clock_tbf_step_s", Link(mbps, burst_bytes=burst))):
        _, compute_s, b = priced_at_cpu_seconds(plan, rank_cpu, {"tp": free, "dp": free}, link)
        bounds[key] = {"full_overlap": b.lower_s, "no_overlap": b.upper_s}
    # one boundary message: a step's stage-link bytes over its two directions, micro-batches and stage pairs
    messages = 2 * plan["micro_batches"] * (plan["layout"]["pp"] - 1)
    return {"rank_cpu_step_s": rank_cpu, "compute_step_s": compute_s, "tbf_burst_bytes": burst,
            "message_bytes": bytes_per_step(plan)["pp"] / messages, **bounds}


def probe_link(rate: str, work: Path, sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """The shaped link alone (netns_hosts/probe.py): per message size, the median seconds after an idle spell beside
    a plain pipe of the rate and tbf's bucket."""
    import json

    from nanotron_ext.bench.netns_hosts.links import tbf_burst_bytes

    bytes_per_s = rate_bits_per_s(rate) / 8
    burst = tbf_burst_bytes(bytes_per_s * 8)
    probe = [sys.executable, "-m", "nanotron_ext.bench.netns_hosts.probe"]
    with Hosts(2, rate=rate, disk_root=work / "hosts_probe") as hosts:
        server = hosts.popen(1, [*probe, "--serve"], cwd=REPO)
        try:
            out = hosts.run(0, [*probe, "--send-to", hosts.addr(1), "--bytes", ",".join(map(str, sizes))],
                            timeout=300, cwd=REPO, capture_output=True, text=True, check=True)
        finally:
            server.kill()
            server.wait()
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        r.update(pipe_s=r["bytes"] / bytes_per_s, tbf_s=max(0.0, r["bytes"] - burst) / bytes_per_s)
    return rows


def emulated_run(config: Path, sets: Sequence[str], mbps: float, out: Path, timeout_s: float) -> Path:
    """The same job on one host (2 processes, torchrun --standalone) through the real-sleep link emulator."""
    run = f"emulated_{int(time.time())}"
    argv = [sys.executable, "-m", "nanotron_ext.launch", "--standalone", "--nproc-per-node", "2",
            "-m", "nanotron_ext.train", "--config-file", str(config)]
    for s in [*sets, f"general.output_dir={out}", f"general.run={run}", f"checkpoints.dir={out}/ckpt_{run}",
              "parallelism.link.enabled=true", f"parallelism.link.bandwidth_mbps={mbps:g}",
              "parallelism.link.latency_ms=0", "logging.progress_bar=false", "checkpoints.interval=0"]:
        argv += ["--set", s]
    try:
        subprocess.run(argv, cwd=REPO, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise JobFailed(f"the one-host emulated run outlived --timeout-s {timeout_s:g} and was stopped; give it "
                        "more time (--timeout-s) or fewer --steps") from None
    return out / run


def measure(rate: str, steps: int, work: Path, codecs: Sequence[str], timeout_s: float) -> List[Dict[str, Any]]:
    """The time points (module doc): per codec, the 2-host job over the shaped link, the clock and the emulator."""
    mbps = rate_bits_per_s(rate) / 1e6
    rows = []
    for codec in codecs:
        sets = [f"tokens.train_steps={steps}", f"tokens.val_check_interval={steps}", "checkpoints.interval=0",
                "logging.rank_cpu_seconds=true", f"model.codec.kind={codec}"]
        disk_at, disks = work / "disk", work / f"hosts_{codec}"
        shutil.rmtree(disks, ignore_errors=True)  # empty disks: a finished run left there would only be resumed
        with Hosts(2, rate=rate, disk_root=disks, disk_at=disk_at) as hosts:
            procs = start_job(hosts, EXAMPLE, [*sets, *disk_sets(disk_at)], work / f"logs_{codec}")
            codes = wait_job(procs, timeout_s)
            if any(getattr(p, "timed_out", False) for p in procs):
                raise JobFailed(f"the 2-host job ({codec}) outlived --timeout-s {timeout_s:g} and was stopped; give "
                                f"it more time (--timeout-s) or fewer --steps (its logs: {work / f'logs_{codec}'})")
            if any(codes):
                log = work / f"logs_{codec}" / "host0.log"
                raise JobFailed(f"the 2-host job ({codec}) failed: {last_line(log)}")
            run_dir = hosts.disk(0) / "runs" / "tiny_two_hosts"
            real = step_times(run_dir)[1:]
            clock = clock_for(EXAMPLE, sets, run_dir, mbps, work / "plans")
        emulated = step_times(emulated_run(EXAMPLE, sets, mbps, work / "emulated", timeout_s))[1:]
        rows.append({"codec": codec, "rate_mbps": mbps, "steps": steps,
                     "real_network_step_s": statistics.fmean(real), "real_network_step_sd": statistics.stdev(real),
                     "emulated_step_s": statistics.fmean(emulated), **clock})
    return rows


HEADERS = ["codec", "link", "shaped 2-host step (s)", "model clock, plain pipe: full / no overlap (s)",
           "model clock, tbf's bucket: full / no overlap (s)", "emulator, one host (s)", "compute at its CPU s (s)",
           "within the bounds (+-15%): pipe, tbf"]


def body(rows: Sequence[Dict[str, Any]]) -> List[List[str]]:
    out = []
    for r in rows:
        cells, verdicts = [], []
        for key in ("clock_step_s", "clock_tbf_step_s"):
            low, high = r[key]["full_overlap"], r[key]["no_overlap"]
            cells.append(f"{low:.3f} / {high:.3f}")
            verdicts.append("yes" if low / 1.15 <= r["real_network_step_s"] <= high * 1.15 else "no")
        out.append([r["codec"], f"{r['rate_mbps']:g} Mbit/s",
                    f"{r['real_network_step_s']:.3f} +- {r['real_network_step_sd']:.3f}", *cells,
                    f"{r['emulated_step_s']:.3f}", f"{r['compute_step_s']:.3f}", ", ".join(verdicts)])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.bench.report import checked_out, publish, run_meta
    from nanotron_ext.cli_flags import Float, Int, Names, OutputFolder, Parser

    parser = Parser(prog="python -m nanotron_ext.bench.multi_host", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbps", type=Float(MIN_RATE_BITS / 1e6, MAX_RATE_BITS / 1e6), default=20.0,
                        help="each host's link rate in Mbit/s (tc tbf on its uplink and downlink; tc takes 8e-06 to "
                             "8e+06), default 20")
    parser.add_argument("--steps", type=Int(3), default=20, help="training steps per run (the first is not timed)")
    parser.add_argument("--codecs", type=Names(CODECS), default=",".join(CODECS),
                        help="the pipeline boundary's codec(s), comma-separated: " + ", ".join(CODECS))
    parser.add_argument("--work", type=OutputFolder(), default="runs/multi_host",
                        help="scratch folder (disks, logs, plans)")
    parser.add_argument("--timeout-s", type=Int(10), default=900, help="per run")
    parser.add_argument("--out", type=checked_out, default="runs/multi_host/real_network_2host.json",
                        help="JSON result (the .md and .png beside it)")
    args = parser.parse_args(argv)
    from nanotron_ext.bench.netns_hosts import available

    why = available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rate, work = f"{args.mbps:g}mbit", Path(args.work).resolve()
    try:
        rows = measure(rate, args.steps, work, args.codecs.split(","), args.timeout_s)
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    probe = probe_link(rate, work, sorted({int(r["message_bytes"]) for r in rows}))
    meta = run_meta({"processes": 2, "command": "python -m nanotron_ext.bench.multi_host "
                     + " ".join(argv if argv is not None else sys.argv[1:])})
    notes = ["Each host: a network namespace with its own tbf-shaped link (no added latency: netem is not in this "
             "kernel) and its own disk; one launcher per host (--nnodes 2, static rendezvous), 2 processes on 2 cores. "
             "The clock prices the run's plan at its ranks' own CPU seconds per step and its messages at the link "
             "rate, as a plain pipe (a preset's link) and with tbf's token bucket (its depth in tbf_burst_bytes: "
             "a step's messages up to it pass at line rate when the bucket refilled since)."]
    alone = [f"{p['bytes']:,} B {p['median_s'] * 1e3:.1f} ms (pipe {p['pipe_s'] * 1e3:.1f}, tbf "
             f"{p['tbf_s'] * 1e3:.1f})" for p in probe]
    notes.append("The link alone (netns_hosts/probe.py: one boundary message after 0.5 s idle, median of 5): "
                 + "; ".join(alone) + ".")
    publish(args.out, rows, meta, "One job on two hosts over a shaped link: measured step vs the model clock",
            HEADERS, body(rows), notes=notes, extra={"link_probe": probe})
    return 0


if __name__ == "__main__":
    sys.exit(main())
