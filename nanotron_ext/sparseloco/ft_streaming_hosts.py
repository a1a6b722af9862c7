"""Fault-tolerant SparseLoCo with the streaming outer sync on two namespaced hosts (issue 52): does the sync hide
behind tau inner steps over a shaped link, and does a replica killed mid inner step heal and go on?

    python -m nanotron_ext.sparseloco.ft_streaming_hosts --mbps 4 --steps 60 --inner-steps 10 --delay 4 \
        --out reproduce/wan/results/ft_streaming_hosts.json

Two network namespaces stand for hosts (bench/netns_hosts), each with its own tbf-shaped link of --mbps and its own
disk; host r runs replica r of examples/config_tiny_sparseloco_ft.yaml as its own one-process job
(`ft_launch --replicas r`, parallelism.dp = 1; host 0 also serves the torchft lighthouse). Being separate jobs the
replicas share no per-step collective: only the outer sync (an all_gather of the compressed pseudo-gradients on
torchft's group) and torchft's quorum cross the link. sparseloco.topk is raised (--topk) so that at --mbps the sync
takes a few inner steps' compute (the result says how many): blocking, it adds sync / H to every step; streaming
(sparseloco.streaming.delay = tau), it runs behind the next tau inner steps.

- blocking (tau 0) and streaming (tau = --delay) runs of --steps steps, min_replicas 2 (every sync has both): the
  measured mean step, the first outer cycle excluded, beside the model clock's bounds for the same job (its twin,
  one dp = 2 job, planned and priced at the replicas' own CPU seconds per step, the outer sync's all_gather over a
  plain pipe of the link's rate: bench/clock/replay.py step_bounds with outer_every = H, outer_overlap = tau);
  blocking against the no-overlap bound, streaming against the tau full-overlap bound, and the overlap achieved
  (the share of the blocking run's sync time the streaming run hid);
- a heal run (streaming, min_replicas 1, a checkpoint every H steps): host 1 is killed while a sync is in flight
  (between a send and its arrival), relaunched at once; it resumes from its disk, heals from replica 0 at its join
  and both train on. Checked: both exit 0, the heal, the membership schedule (the steps each replica synced with its
  peer or alone, from the comm ledger: a one-replica quorum sends nothing), and that at every outer sync count both
  replicas checkpointed the global weights are bit for bit equal.

Timing needs no more busy processes than cores (2 here): run it on an idle machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.bench.multi_host import REPO, JobFailed, last_line, wait_job
from nanotron_ext.bench.netns_hosts import Hosts

EXAMPLE = REPO / "examples" / "config_tiny_sparseloco_ft.yaml"
RUN = "ft_streaming"
LIGHTHOUSE_PORT = 29510
RUNS = ("blocking", "streaming", "heal")
HEALED = "took the global weights and outer state of outer sync"


def job_sets(lighthouse: str, disk_at: Path, steps: int, inner: int, delay: int, topk: int, min_replicas: int,
             interval: int, extra: Sequence[str]) -> List[str]:
    """Every replica's overrides (ft_launch adds the replica's index, run name and checkpoint folder)."""
    return ["sparseloco.fault_tolerance.enabled=true", f"sparseloco.fault_tolerance.lighthouse={lighthouse}",
            "sparseloco.fault_tolerance.replicas=2", f"sparseloco.fault_tolerance.min_replicas={min_replicas}",
            "parallelism.dp=1", f"sparseloco.inner_steps={inner}", f"sparseloco.streaming.delay={delay}",
            f"sparseloco.topk={topk}", f"tokens.train_steps={steps}", f"tokens.val_check_interval={steps}",
            f"checkpoints.interval={interval}", "checkpoints.keep_last=1000", "checkpoints.storage=per_host",
            f"checkpoints.dir={disk_at}/ckpt", f"general.output_dir={disk_at}/runs", "logging.progress_bar=false",
            "logging.rank_cpu_seconds=true", f"general.run={RUN}", *extra]


def launch_replica(hosts: Hosts, i: int, sets: Sequence[str], log: Path) -> subprocess.Popen:
    """Host i's replica (host 0 also serves the lighthouse); its output in `log`."""
    argv = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", "--config-file", str(EXAMPLE), "--replicas",
            str(i), "--max-restarts", "0", *(["--no-lighthouse"] if i else []),
            *[x for s in sets for x in ("--set", s)]]
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "w")  # noqa: SIM115 - closed by wait_job
    proc = hosts.popen(i, argv, env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    proc.log = out  # type: ignore[attr-defined]
    return proc


def run_dir(hosts: Hosts, i: int) -> Path:
    return hosts.disk(i) / "runs" / f"{RUN}_r{i}"


def records(run: Path) -> List[Dict[str, Any]]:
    from nanotron_ext.metrics.logger import read_metrics

    metrics = run / "metrics.jsonl"
    return [r for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []


def membership(rows: Sequence[Dict[str, Any]], inner: int) -> Dict[str, List[int]]:
    """The steps at which this replica's outer sync gathered with its peer (bytes on torchft's group: a send, or a
    retry at an arrival) and the send steps at which it was alone (a one-replica group crosses no boundary, so the
    ledger records nothing)."""
    peer = [r["step"] for r in rows if r["comm_bytes"].get("ft", 0) > 0]
    alone = [r["step"] for r in rows if r["step"] % inner == 0 and r["comm_bytes"].get("ft", 0) == 0]
    return {"with_peer": peer, "alone": alone}


def replica_row(run: Path, inner: int) -> Dict[str, Any]:
    """Losses, the mean step and CPU seconds per step after the first outer cycle, and the membership schedule."""
    rows = records(run)
    timed = [r for r in rows if r["step"] > inner] or rows[1:]
    return {"steps": len(rows), "losses": [r["loss"] for r in rows],
            "mean_step_s": statistics.fmean(r["step_time_s"] for r in timed),
            "cpu_step_s": statistics.fmean(sum(r.get("rank_cpu_s", [0.0])) for r in timed),
            "membership": membership(rows, inner)}


def clock_bounds(sets: Sequence[str], cpu_s: Sequence[float], mbps: float, cache: Path) -> Dict[str, Any]:
    """The model clock's bounds of the two replicas as one dp = 2 job (its twin: the planner builds no torchft
    sync) at `cpu_s`, its ranks' CPU seconds per step (one throughput for the job: their mean), the outer sync's
    all_gather over a plain pipe of `mbps` (a payload well above tbf's bucket: the bucket's share is said beside
    it)."""
    from nanotron_ext.bench.clock import Link, planned, priced_at_cpu_seconds, replica_works
    from nanotron_ext.bench.netns_hosts.links import tbf_burst_bytes

    twin = [*sets, "sparseloco.fault_tolerance.enabled=false", "parallelism.dp=2"]
    plan = planned(str(EXAMPLE), twin, cache)
    free = Link(0.0)
    tiers = {"tp": free, "dp": Link(mbps)}
    flops_per_s, compute_s, b = priced_at_cpu_seconds(plan, list(cpu_s), tiers, free)
    outer_s = max(max(w.outer_s or [0.0]) for w in replica_works(plan, tiers, [free, free], flops_per_s))
    burst = tbf_burst_bytes(mbps * 1e6)
    return {"compute_step_s": compute_s, "outer_sync_s": outer_s, "outer_every": plan["outer_every"],
            "outer_overlap": plan.get("outer_overlap", 0), "full_overlap_s": b.lower_s, "no_overlap_s": b.upper_s,
            "tbf_burst_s": burst * 8 / (mbps * 1e6), "cpu_step_s": list(cpu_s)}


def timed_run(name: str, rate: str, mbps: float, args: argparse.Namespace, delay: int, work: Path) -> Dict[str, Any]:
    """One run of both replicas to the end (min_replicas 2): per replica its row, and the clock's bounds."""
    disk_at, disks = work / "disk", work / f"hosts_{name}"
    shutil.rmtree(disks, ignore_errors=True)  # empty disks: a finished run would only be resumed
    with Hosts(2, rate=rate, disk_root=disks, disk_at=disk_at) as hosts:
        sets = job_sets(f"http://{hosts.addr(0)}:{LIGHTHOUSE_PORT}", disk_at, args.steps, args.inner_steps, delay,
                        args.topk, 2, 0, args.set)
        logs = work / f"logs_{name}"
        procs = [launch_replica(hosts, i, sets, logs / f"host{i}.log") for i in range(2)]
        check_codes(name, procs, wait_job(procs, args.timeout_s), logs)
        rows = {i: replica_row(run_dir(hosts, i), args.inner_steps) for i in range(2)}
    slower = max(r["cpu_step_s"] for r in rows.values())  # the replicas meet at every quorum: the slower paces
    clock = clock_bounds(sets, [slower, slower], mbps, work / "plans")
    measured = max(r["mean_step_s"] for r in rows.values())
    bound = clock["no_overlap_s"] if delay == 0 else clock["full_overlap_s"]
    return {"run": name, "delay": delay, "replicas": rows, "clock": clock, "measured_step_s": measured,
            "bound": "no overlap" if delay == 0 else f"full overlap behind tau = {delay}", "bound_s": bound,
            "measured_over_bound": measured / bound}


def check_codes(name: str, procs: Sequence[subprocess.Popen], codes: Sequence[int], logs: Path) -> None:
    if any(getattr(p, "timed_out", False) for p in procs) or any(codes):
        raise JobFailed(f"the {name} run failed (exit codes {list(codes)}; logs in {logs}): "
                        + " | ".join(last_line(p) for p in sorted(logs.glob("host*.log"))))


def heal_run(rate: str, args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    """The streaming job with host 1 killed while a sync is in flight and relaunched at once (module docstring)."""
    from nanotron_ext.train.checkpoint_store import list_checkpoints

    h, tau = args.inner_steps, args.delay
    disk_at, disks, logs = work / "disk", work / "hosts_heal", work / "logs_heal"
    shutil.rmtree(disks, ignore_errors=True)
    with Hosts(2, rate=rate, disk_root=disks, disk_at=disk_at) as hosts:
        sets = job_sets(f"http://{hosts.addr(0)}:{LIGHTHOUSE_PORT}", disk_at, args.heal_steps, h, tau, args.topk, 1,
                        h, args.set)
        procs = [launch_replica(hosts, i, sets, logs / f"host{i}.log") for i in range(2)]
        deadline = time.monotonic() + args.timeout_s
        while True:  # both training and synced together once (a replica that starts late heals from the other at
            # its join: killing its source then would only fail that heal), replica 1 past a checkpoint, and a sync
            # with its peer in flight (sent at a multiple of H with replica 0 in the quorum, arriving at + tau)
            rows, peer = records(run_dir(hosts, 1)), records(run_dir(hosts, 0))
            last = rows[-1]["step"] if rows else 0
            sent = next((r for r in rows if r["step"] == last - last % h), None)
            if (0 < last % h < tau and sent is not None and sent["comm_bytes"].get("ft", 0) > 0
                    and any(r["comm_bytes"].get("ft", 0) > 0 for r in peer)
                    and list_checkpoints(hosts.disk(1) / "ckpt_r1", [])):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                wait_job(procs, 1)
                raise JobFailed(f"the heal run ended or outlived --timeout-s before host 1 could be killed mid sync "
                                f"(replica 1 at step {last}; logs in {logs})")
            time.sleep(0.05)
        hosts.kill_host(1)  # host 1 dies: its launcher and its replica, mid inner step with a sync in flight
        peer_at_kill = max((r["step"] for r in records(run_dir(hosts, 0))), default=0)
        procs[1].log.close()  # type: ignore[attr-defined]
        procs[1] = launch_replica(hosts, 1, sets, logs / "host1_again.log")  # the host comes back
        check_codes("heal", procs, wait_job(procs, max(1.0, deadline - time.monotonic())), logs)
        again = (logs / "host1_again.log").read_text(errors="replace")
        healed = [line.strip() for line in again.splitlines() if HEALED in line]
        retries = [line.strip() for line in (logs / "host0.log").read_text(errors="replace").splitlines()
                   if "attempt" in line and "failed" in line]
        resumed = [line.strip() for line in again.splitlines() if "resumed from" in line]
        rows = {i: replica_row(run_dir(hosts, i), h) for i in range(2)}
        if not healed:
            raise JobFailed(f"replica 1 rejoined without healing from replica 0 (it finished first? more "
                            f"--heal-steps); logs in {logs}")
        since = int(re.search(r"outer sync (\d+)", healed[0]).group(1))
        agree = global_weights_agree(hosts.disk(0) / "ckpt_r0", hosts.disk(1) / "ckpt_r1", since)
    return {"run": "heal", "delay": tau, "killed_at_step": {"replica_1": last, "replica_0": peer_at_kill},
            "resumed": resumed, "healed": healed, "retries_on_replica_0": retries, "replicas": rows,
            "global_weights": agree}


def global_weights_agree(root0: Path, root1: Path, since: int) -> Dict[str, Any]:
    """Per outer sync count from `since` (the heal's) checkpointed by both replicas: whether their global weights
    are bit for bit equal (before it, a replica that started first may have synced alone)."""
    import torch

    from nanotron_ext.train.checkpoint_store import list_checkpoints

    def by_syncs(root: Path) -> Dict[int, Dict[str, torch.Tensor]]:
        out = {}
        for _, path in list_checkpoints(root):
            state = torch.load(path / "pp0_dp0_tp0.pt", map_location="cpu", weights_only=True)["extra"]["dp_sync"]
            out.setdefault(int(state["syncs"]), state["global"])
        return out

    a, b = by_syncs(root0), by_syncs(root1)
    common = sorted(s for s in set(a) & set(b) if s >= since)
    equal = [s for s in common if a[s].keys() == b[s].keys() and all(torch.equal(a[s][k], b[s][k]) for k in a[s])]
    return {"since_sync": since, "syncs_compared": common, "equal": equal,
            "all_equal": bool(common) and equal == common}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.bench.netns_hosts import available, rate_bits_per_s
    from nanotron_ext.bench.netns_hosts.links import MAX_RATE_BITS, MIN_RATE_BITS
    from nanotron_ext.bench.report import REPORT, checked_out, run_meta
    from nanotron_ext.cli_flags import Float, Int, KeyValue, Names, OutputFolder, Parser

    parser = Parser(prog="python -m nanotron_ext.sparseloco.ft_streaming_hosts", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbps", type=Float(MIN_RATE_BITS / 1e6, MAX_RATE_BITS / 1e6), default=4.0,
                        help="each host's link rate in Mbit/s (tc tbf), default 4")
    parser.add_argument("--steps", type=Int(3), default=60, help="steps of each timed run, default 60")
    parser.add_argument("--heal-steps", type=Int(3), default=120,
                        help="steps of the heal run (replica 0 must still train when replica 1 is back), default 120")
    parser.add_argument("--inner-steps", type=Int(2), default=10, help="SparseLoCo's H, default 10")
    parser.add_argument("--delay", type=Int(1), default=4,
                        help="the streaming run's tau (< H; the heal kills a replica between a send and its arrival, "
                        "so 2 or more), default 4")
    parser.add_argument("--topk", type=Int(1), default=512,
                        help="sparseloco.topk per 4096-chunk: the sync's payload, default 512")
    parser.add_argument("--runs", type=Names(RUNS), default=",".join(RUNS), help="which runs, default all")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                        help="config overrides for every run (a smaller model, another corpus), default none")
    parser.add_argument("--work", type=OutputFolder(), default="runs/ft_streaming_hosts", help="scratch folder")
    parser.add_argument("--timeout-s", type=Int(10), default=900, help="per run, default 900")
    parser.add_argument("--out", type=checked_out, default="runs/ft_streaming_hosts/ft_streaming_hosts.json",
                        help="JSON result (a .md and .png beside it); a committed result is replaced only when named "
                        "here")
    args = parser.parse_args(argv)
    if args.delay >= args.inner_steps:
        print(f"error: --delay {args.delay}: must be below --inner-steps {args.inner_steps}", file=sys.stderr)
        return 2
    if "heal" in args.runs.split(",") and args.delay < 2:
        print(f"error: --delay {args.delay}: the heal run kills a replica between a send and its arrival, a step "
              "apart at least: give 2 or more (or leave heal out of --runs)", file=sys.stderr)
        return 2
    why = available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rate, work = f"{args.mbps:g}mbit", Path(args.work).resolve()
    mbps = rate_bits_per_s(rate) / 1e6
    runs = args.runs.split(",")
    result: Dict[str, Any] = {"rate_mbps": mbps, "steps": args.steps, "inner_steps": args.inner_steps,
                              "delay": args.delay, "topk": args.topk, "sets": args.set, "cores": os.cpu_count(),
                              "processes": 2, "runs": {}}
    try:
        for name in runs:
            if name == "heal":
                result["runs"][name] = heal_run(rate, args, work)
            else:
                delay = 0 if name == "blocking" else args.delay
                result["runs"][name] = timed_run(name, rate, mbps, args, delay, work)
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    result["overlap"] = overlap(result["runs"])
    result["meta"] = run_meta({"processes": 2, "command": "python -m nanotron_ext.sparseloco.ft_streaming_hosts "
                               + " ".join(argv if argv is not None else sys.argv[1:])})
    out = Path(args.out)
    REPORT.write_json(out, result)
    REPORT.write_markdown(out.with_suffix(".md"), render(result))
    figure(result, out.with_suffix(".png"))
    print(render(result))
    return 0


def figure(result: Dict[str, Any], png: Path) -> None:
    """Per timed run: the measured step beside the clock's full- and no-overlap bounds (none without one)."""
    from nanotron_ext.bench.report import grouped_bars, new_figure, save_figure

    timed = [r for r in result["runs"].values() if "clock" in r]
    if not timed:
        return
    fig, ax = new_figure(1, width=6.0, height=4.0)
    grouped_bars(ax, [f"{r['run']} (tau {r['delay']})" for r in timed],
                 {"measured": [r["measured_step_s"] for r in timed],
                  "clock, full overlap": [r["clock"]["full_overlap_s"] for r in timed],
                  "clock, no overlap": [r["clock"]["no_overlap_s"] for r in timed]}, ylabel="step (s)")
    ax.legend(fontsize=8)
    save_figure(fig, png, f"Streaming vs blocking outer sync, two hosts at {result['rate_mbps']:g} Mbit/s",
                result["meta"])


def overlap(runs: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """The share of the blocking run's measured sync time (its step less the streaming run's compute) that the
    streaming run hid: 1 when its step is its compute alone, 0 when it is the blocking run's."""
    if "blocking" not in runs or "streaming" not in runs:
        return None
    blocking, streaming = runs["blocking"]["measured_step_s"], runs["streaming"]["measured_step_s"]
    compute = runs["streaming"]["clock"]["compute_step_s"]
    sync = blocking - compute
    return {"blocking_sync_per_step_s": sync, "hidden_per_step_s": blocking - streaming,
            "overlap": (blocking - streaming) / sync if sync > 0 else float("nan")}


def render(result: Dict[str, Any]) -> str:
    """The result as markdown: the timed runs beside the clock, the heal."""
    m, runs = result["meta"], result["runs"]
    lines = [f"# Streaming fault-tolerant SparseLoCo on two namespaced hosts ({m['date']})", "",
             f"`{m['command']}`: {m['machine']}, commit {m['commit']}, load average {m['loadavg_1m']:.2f}; "
             f"{result['processes']} replicas (one process each) on {result['cores']} cores, each host's link "
             f"{result['rate_mbps']:g} Mbit/s (tc tbf), H = {result['inner_steps']}, top-{result['topk']} per chunk.",
             ""]
    timed = [r for r in runs.values() if "clock" in r]
    if timed:
        c = timed[0]["clock"]
        lines += [f"The outer sync's all_gather takes {c['outer_sync_s']:.3f} s at the link's rate: "
                  f"{c['outer_sync_s'] / c['compute_step_s']:.1f} inner steps of compute ({c['compute_step_s']:.3f} "
                  f"s at the replicas' CPU seconds; tbf's bucket passes {c['tbf_burst_s']:.3f} s of it at line rate "
                  "after an idle spell).", "",
                  "| run | tau | measured step (s), first cycle excluded | clock: full overlap / no overlap (s) | "
                  "bound | measured / bound |", "|---|---|---|---|---|---|"]
        for r in timed:
            lines.append(f"| {r['run']} | {r['delay']} | {r['measured_step_s']:.3f} | "
                         f"{r['clock']['full_overlap_s']:.3f} / {r['clock']['no_overlap_s']:.3f} | {r['bound']} | "
                         f"{r['measured_over_bound']:.3f} |")
    if result.get("overlap"):
        o = result["overlap"]
        lines += ["", f"Overlap achieved: the streaming run hid {o['hidden_per_step_s']:.3f} s of the blocking run's "
                  f"{o['blocking_sync_per_step_s']:.3f} s of sync per step ({o['overlap']:.0%})."]
    if "heal" in runs:
        r = runs["heal"]
        g, k = r["global_weights"], r["killed_at_step"]
        lines += ["", f"Heal (tau = {r['delay']}): host 1 killed at replica 1's step {k['replica_1']} (replica 0 at "
                  f"step {k['replica_0']}), a sync in flight; relaunched at once. "
                  + (f"{r['resumed'][0]}; " if r["resumed"] else "") + f"{r['healed'][0]}.",
                  f"Replica 0's retried syncs: {len(r['retries_on_replica_0'])}. Global weights at the outer syncs "
                  f"both replicas checkpointed from the heal's on ({_spans(g['syncs_compared'])}): "
                  + ("bit for bit equal." if g["all_equal"] else f"equal only at {_spans(g['equal'])}."), "",
                  "| replica | steps | syncs with the peer at steps | alone at steps | loss first / last |",
                  "|---|---|---|---|---|"]
        for i, row in r["replicas"].items():
            ms = row["membership"]
            lines.append(f"| {i} | {row['steps']} | {_spans(ms['with_peer'])} | {_spans(ms['alone'])} | "
                         f"{row['losses'][0]:.4f} / {row['losses'][-1]:.4f} |")
    if result["processes"] > (result["cores"] or 0) or (m["loadavg_1m"] or 0) > 0.5 * (result["cores"] or 1):
        lines += ["", "A loaded machine or more processes than cores: the steps time the contention, not the job."]
    return "\n".join(lines) + "\n"


def _spans(steps: Sequence[int]) -> str:
    """Steps as runs: 4..96 every 4, 272..400 every 4 (a run of three or more at the smallest gap), else listed."""
    if not steps:
        return "-"
    gap = min((b - a for a, b in zip(steps, steps[1:])), default=1)
    runs: List[List[int]] = [[steps[0]]]
    for s in steps[1:]:
        if s - runs[-1][-1] == gap:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}..{r[-1]} every {gap}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


if __name__ == "__main__":
    sys.exit(main())
