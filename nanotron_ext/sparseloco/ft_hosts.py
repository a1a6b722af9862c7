"""The three-tier composed job as fault-tolerant SparseLoCo replicas on namespaced hosts (issue 52 item 4):
BOOST's bottleneck-aware TP inside a stage, the subspace codec on the stage link, heterogeneous SparseLoCo between
the replicas, each replica a torchft replica group.

    python -m nanotron_ext.sparseloco.ft_hosts --steps 10 --mbps 20 \
        --out reproduce/wan/results/ft_three_tiers_hosts.json

Three network namespaces stand for hosts (bench/netns_hosts), each with its own tbf-shaped link and disk: host 0
runs the datacenter replica (replica 0: tp 2 x pp 2, 4 processes, uncompressed) and the torchft lighthouse
(`ft_launch --replicas 0`); hosts 1 and 2 run replica 1, a stage per host (`nanotron_ext.launch --nnodes 2
--nproc-per-node 2`: its TP pair inside the host, its compressed stage boundary over the shaped link). Both replicas
train examples/config_three_tiers.yaml's tiny Llama with `sparseloco.fault_tolerance.min_replicas=2` (every sync
has both). Reported: each replica's losses, its measured inner and sync steps, the bytes per step per tier from the
comm ledger beside the closed forms (config/tiers.py), and replica 1's model-clock bounds for the link's rate at
its ranks' own CPU seconds (bench/multi_host.clock_for). The processes outnumber this machine's cores when it has
fewer than 8: the measured step then times the oversubscription, not any hardware (said in the result).

    python -m nanotron_ext.sparseloco.ft_hosts --steps 30 --inner-steps 5 --mbps 20 --streaming-delay 1 \
        --kill-host 2 --kill-at-step 7 --out reproduce/wan/results/ft_three_tiers_hosts_streaming.json

adds the streaming outer sync (`--streaming-delay TAU`: sparseloco.streaming.delay, alpha 0.5) and a host lost and
regained (`--kill-host N --kill-at-step S`, ft_hosts_fault.py): min_replicas 1 and a checkpoint every H; host N dies
in its replica's step S + 1 and is relaunched, the replica resumes its checkpoint, rejoins and heals each rank from
its peer rank. Reported besides: the lighthouse's quorums in order (the membership schedule), joins, heals, failed
attempts, whether every replica has a loss for every step, and the clock's bounds with the sync on the wire (blocking,
and streaming: hidden behind tau inner steps only). No reference loss is computed for this job (REFERENCE says why).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.bench.multi_host import REPO, JobFailed, clock_for, last_line, launcher_argv, wait_job
from nanotron_ext.bench.netns_hosts import Hosts

EXAMPLE = REPO / "examples" / "config_three_tiers.yaml"
RUN = "ft_three_tiers"
PROCESSES = 8  # two replicas of tp 2 x pp 2
GROUPS = ("tp", "pp", "ft")  # the comm ledger's groups: TP, the stage link, torchft's outer sync
REFERENCE = ("not computed: replica 0 is tp 2 x pp 2 and replica 1 has a TP pair per stage, whose sharded matmuls "
             "and all-reduces sum in another order than a one-process model, so no reference is bit-equal (the "
             "pipeline-only job is checked bit for bit against its membership schedule in "
             "tests/test_ft_cross_host.py; streaming + torchft + heterogeneous replicas against a float64 reference "
             "in tests/test_sparseloco_streaming_hetero_ft.py)")


def job_sets(lighthouse: str, disk_at: Path, steps: int, inner: int, delay: int = 0, faulted: bool = False,
             alpha: float = 0.5) -> List[str]:
    """The job's --set list; `delay` > 0: the streaming outer sync; `faulted`: a host is killed, so checkpoints
    every H and min_replicas 1 (the live replica syncs alone while the other is away)."""
    sets = ["sparseloco.fault_tolerance.enabled=true", f"sparseloco.fault_tolerance.lighthouse={lighthouse}",
            "sparseloco.fault_tolerance.replicas=2", f"sparseloco.fault_tolerance.min_replicas={1 if faulted else 2}",
            "sparseloco.compressed_replicas=[1]", "parallelism.dp=1", "parallelism.link.enabled=false",
            f"sparseloco.inner_steps={inner}", f"tokens.train_steps={steps}", f"tokens.val_check_interval={steps}",
            f"checkpoints.interval={inner if faulted else 0}", "checkpoints.storage=per_host",
            f"checkpoints.dir={disk_at}/ckpt", f"general.output_dir={disk_at}/runs", "logging.progress_bar=false",
            "logging.rank_cpu_seconds=true", f"general.run={RUN}"]
    if delay:
        sets += [f"sparseloco.streaming.delay={delay}", f"sparseloco.streaming.alpha={alpha:g}"]
    return sets


def wan_sets(sets: Sequence[str], disk_at: Path) -> List[str]:
    return [*sets, "sparseloco.fault_tolerance.replica=1", f"general.run={RUN}_r1",
            f"checkpoints.dir={disk_at}/ckpt_r1"]


def starter(hosts: Hosts, sets: List[str], disk_at: Path, logs: Path, faulted: bool = False
            ) -> Callable[[int, str], subprocess.Popen]:
    """start(h, tag): host h's launcher, its output in logs/host{h}_{tag}.log. Host 0: replica 0 and the lighthouse
    (ft_launch); hosts 1 and 2: replica 1, a stage each (static rendezvous at host 1)."""
    logs.mkdir(parents=True, exist_ok=True)
    # faulted: the lighthouse forms a quorum 5 s after a replica stops heartbeating, not after ft_launch's 60
    lighthouse = ["--join-timeout-ms", "5000"] if faulted else []
    dc = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", "--config-file", str(EXAMPLE), "--replicas",
          "0", "--nproc_per_node", "4", "--max-restarts", "0", *lighthouse, *[x for s in sets for x in ("--set", s)]]

    def start(h: int, tag: str) -> subprocess.Popen:
        cmd = dc if h == 0 else launcher_argv(EXAMPLE, h - 1, 2, hosts.addr(1), wan_sets(sets, disk_at), nproc=2)
        out = open(logs / f"host{h}_{tag}.log", "w")  # noqa: SIM115 - closed by wait_job
        proc = hosts.popen(h, cmd, env={"OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        proc.log = out  # type: ignore[attr-defined]
        return proc
    return start


def run_job(hosts: Hosts, sets: List[str], disk_at: Path, logs: Path, timeout_s: float) -> None:
    start = starter(hosts, sets, disk_at, logs)
    procs = [start(h, "a") for h in range(3)]
    codes = wait_job(procs, timeout_s)
    if any(getattr(p, "timed_out", False) for p in procs) or any(codes):
        raise JobFailed(f"the job failed (exit codes {codes}; logs in {logs}): {last_line(logs / 'host0_a.log')} | "
                        f"{last_line(logs / 'host1_a.log')}")


def replica_row(run_dir: Path, inner: int, closed: Dict[str, Optional[float]], delay: int = 0) -> Dict[str, Any]:
    """Losses, inner and sync step times (each launch's first step left out), and per tier the ledger's bytes of an
    inner step beside the closed form, and what a sync adds (the SparseLoCo payload gather, ft; the embedding fold,
    tp and pp; streaming: its send step and its arrival step together). A replica relaunched from a checkpoint logs
    some steps twice: `losses` holds each step's last (the run that went on), `replayed` the first tries."""
    import json

    from nanotron_ext.metrics.logger import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    timed = [r for i, r in enumerate(records) if i and r["step"] > records[i - 1]["step"]]  # not a launch's first
    syncs = {0, delay} if delay else {0}
    inner_s = [r["step_time_s"] for r in timed if r["step"] % inner not in syncs]
    sync_s = [r["step_time_s"] for r in timed if r["step"] % inner in syncs]
    one = next(r["comm_bytes"] for r in timed if r["step"] % inner not in syncs)
    # a sync's extra bytes: its send step and its arrival step less two inner steps' (the blocking sync: one step);
    # of the syncs both replicas sent in and that arrived (a relaunched replica drops the one it held in flight), the
    # smallest (a heal's recovery bytes fall in its step too)
    at = {r["step"]: r["comm_bytes"] for r in records}
    cycles = [{g: sum(at[t + d].get(g, 0) - one.get(g, 0) for d in {0, delay}) for g in GROUPS}
              for t in sorted(at) if not t % inner and t + delay in at]
    sync = min(cycles, key=lambda c: (c["ft"] <= 0, c["tp"] <= 0, c["ft"])) if cycles else {g: 0 for g in GROUPS}
    wire = one.get("pp:send:fwd", 0) + one.get("pp:send:bwd", 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    by_step = {r["step"]: r["loss"] for r in records}
    return {"losses": [by_step[s] for s in sorted(by_step)], "final_val_loss": summary.get("final_val_loss"),
            "replayed": {r["step"]: r["loss"] for i, r in enumerate(records) if any(
                q["step"] == r["step"] for q in records[i + 1:])},
            "steps_logged": sorted(by_step),
            "inner_step_s": statistics.median(inner_s) if inner_s else None,
            "sync_step_s": statistics.median(sync_s) if sync_s else None,
            # per step over a cycle, from the medians (a paced replica's mean would time its SIGSTOPs)
            "cycle_step_s": ((inner - len(syncs)) * statistics.median(inner_s) + len(syncs) * statistics.median(
                sync_s)) / inner if inner_s and sync_s else None,
            "ledger_inner_step_bytes": {"tp": one.get("tp", 0), "pp": one.get("pp", 0), "pp_wire": wire},
            "ledger_sync_extra_bytes": sync, "closed_form_bytes_per_step": closed}


def closed_forms(sets: Sequence[str]) -> Dict[str, Optional[float]]:
    """Bytes per step per tier (config/tiers.py), and one outer sync's payload (SparseLoCo's closed form: the
    unsharded model's tensors; each TP rank compresses its own shards, so the ledger reads more)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step
    from nanotron_ext.sparseloco import technique

    cfg = load_config(str(EXAMPLE), list(sets))
    sync = technique.closed_form_bytes("parallelism.dp_sync", "sparseloco", cfg)
    return {**job_bytes_per_step(cfg), "outer_sync": sync.forward * cfg.sparseloco.inner_steps}


def measure(rate: str, mbps: float, steps: int, inner: int, work: Path, timeout_s: float, delay: int = 0,
            kill: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """The run (`kill`: (host, replica step after which it dies), ft_hosts_fault) and its report."""
    from nanotron_ext.sparseloco.ft_hosts_fault import kill_and_relaunch, nothing_lost, streaming_clock

    disk_at, disks = work / "disk", work / "hosts"
    shutil.rmtree(disks, ignore_errors=True)  # empty disks: a finished run would only be reported again
    shutil.rmtree(work / "logs", ignore_errors=True)
    with Hosts(3, rate=rate, disk_root=disks, disk_at=disk_at) as hosts:
        sets = job_sets(f"http://{hosts.addr(0)}:29510", disk_at, steps, inner, delay, kill is not None)
        runs = {0: hosts.disk(0) / "runs" / f"{RUN}_r0", 1: hosts.disk(1) / "runs" / f"{RUN}_r1"}
        schedule = None
        if kill is None:
            run_job(hosts, sets, disk_at, work / "logs", timeout_s)
        else:
            ckpts = {0: [hosts.disk(0) / "ckpt_r0"], 1: [hosts.disk(h) / "ckpt_r1" for h in (1, 2)]}
            schedule = kill_and_relaunch(hosts, starter(hosts, sets, disk_at, work / "logs", faulted=True),
                                         kill[0], kill[1], runs, ckpts, work / "logs", timeout_s)
        rows = {r: replica_row(d, inner, closed_forms([*sets, f"sparseloco.fault_tolerance.replica={r}"]), delay)
                for r, d in runs.items()}
        # the planner builds no torchft sync: its twin is the same replica as the only one of a plain run
        twin = [*wan_sets(sets, disk_at), "sparseloco.fault_tolerance.enabled=false",
                "sparseloco.compressed_replicas=[0]"]
        rows[1]["clock"] = clock_for(EXAMPLE, twin, runs[1], mbps, work / "plans")
    result = {"replicas": rows, "rate_mbps": mbps, "steps": steps, "inner_steps": inner,
              "cores": os.cpu_count(), "processes": PROCESSES}
    if delay or kill is not None:  # keys the committed blocking run's result does not have
        rows[1]["clock"]["outer_sync"] = streaming_clock(rows[1], mbps, inner, delay)
        result.update(streaming_delay=delay, alpha=0.5 if delay else None, schedule=schedule,
                      missing_steps=nothing_lost({r: dict(zip(row["steps_logged"], row["losses"]))
                                                  for r, row in rows.items()}, steps),
                      reference=REFERENCE)
    return result


def flag_problem(steps: int, inner: int, delay: int, host: Optional[int], at: Optional[int]) -> Optional[str]:
    """One line naming the flag and value that cannot run, or None."""
    if delay >= inner:
        return f"--streaming-delay {delay}: must be below --inner-steps {inner} (the sync arrives before the next send)"
    if (host is None) != (at is None):
        return "--kill-host and --kill-at-step go together (got only " + ("--kill-host)" if at is None else
                                                                          "--kill-at-step)")
    if host is not None and host > 2:
        return f"--kill-host {host}: the job has hosts 0, 1 and 2"
    if at is not None and not inner < at < steps:
        return (f"--kill-at-step {at}: must be after the first checkpoint (--inner-steps {inner}) and before the last "
                f"step (--steps {steps})")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.bench.netns_hosts import available, rate_bits_per_s
    from nanotron_ext.bench.netns_hosts.links import MAX_RATE_BITS, MIN_RATE_BITS
    from nanotron_ext.bench.report import REPORT, checked_out, run_meta
    from nanotron_ext.cli_flags import Float, Int, OutputFolder, Parser

    parser = Parser(prog="python -m nanotron_ext.sparseloco.ft_hosts", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbps", type=Float(MIN_RATE_BITS / 1e6, MAX_RATE_BITS / 1e6), default=20.0,
                        help="each host's link rate in Mbit/s (tc tbf), default 20")
    parser.add_argument("--steps", type=Int(3), default=10, help="training steps of each replica")
    parser.add_argument("--inner-steps", type=Int(2), default=5, help="SparseLoCo's H")
    parser.add_argument("--work", type=OutputFolder(), default="runs/ft_hosts", help="scratch folder")
    parser.add_argument("--timeout-s", type=Int(10), default=1800)
    parser.add_argument("--out", type=checked_out, default="runs/ft_hosts/ft_three_tiers_hosts.json",
                        help="JSON result (a .md beside it)")
    parser.add_argument("--streaming-delay", type=Int(0), default=0, metavar="TAU",
                        help="sparseloco.streaming.delay (alpha 0.5): the outer sync in flight for TAU inner steps; "
                             "0 (default): the blocking sync")
    parser.add_argument("--kill-host", type=Int(0), default=None, metavar="N",
                        help="kill host N (0: the datacenter replica and the lighthouse; 1 or 2: a stage of replica "
                             "1) after its replica's step --kill-at-step, relaunch it; default: no fault")
    parser.add_argument("--kill-at-step", type=Int(1), default=None, metavar="S",
                        help="the replica step after which --kill-host dies (> --inner-steps: a checkpoint exists)")
    args = parser.parse_args(argv)
    problem = flag_problem(args.steps, args.inner_steps, args.streaming_delay, args.kill_host, args.kill_at_step)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    why = available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rate = f"{args.mbps:g}mbit"
    try:
        kill = None if args.kill_host is None else (args.kill_host, args.kill_at_step)
        result = measure(rate, rate_bits_per_s(rate) / 1e6, args.steps, args.inner_steps, Path(args.work).resolve(),
                         args.timeout_s, args.streaming_delay, kill)
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    result["meta"] = run_meta({"processes": PROCESSES, "command": "python -m nanotron_ext.sparseloco.ft_hosts "
                               + " ".join(argv if argv is not None else sys.argv[1:])})
    out = Path(args.out)  # marked as the reproduction scripts' results are (a rerun may replace them)
    REPORT.write_json(out, result)
    REPORT.write_markdown(out.with_suffix(".md"), render(result))
    print(render(result))
    return 0


def render(result: Dict[str, Any]) -> str:
    """The result as markdown: per replica its losses, steps and bytes per tier; replica 1's clock bounds."""
    m = result["meta"]
    lines = [f"# The three-tier job as fault-tolerant replicas on namespaced hosts ({m['date']})", "",
             f"`{m['command']}`: {result['processes']} processes on {result['cores']} cores (load "
             f"{m['loadavg_1m']:.1f}), each host's link {result['rate_mbps']:g} Mbit/s, {result['steps']} steps, "
             f"H = {result['inner_steps']}.", "",
             "| replica | train loss: first / last | validation loss | inner step (s) | sync step (s) | "
             "TP bytes per inner step: ledger / closed form | stage wire: ledger / closed form | "
             "a sync adds: ft / tp / pp | outer sync payload closed form (unsharded) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, row in result["replicas"].items():
        led, cf = row["ledger_inner_step_bytes"], row["closed_form_bytes_per_step"]
        add = row["ledger_sync_extra_bytes"]
        lines.append(f"| {r} | {row['losses'][0]:.4f} / {row['losses'][-1]:.4f} | {row['final_val_loss']:.4f} | "
                     f"{row['inner_step_s']:.3f} | {row['sync_step_s']:.3f} | "
                     f"{led['tp']:,} / {cf.get('tp') or 0:,.0f} | {led['pp_wire']:,} / {cf.get('pp') or 0:,.0f} | "
                     f"{add['ft']:,} / {add['tp']:,} / {add['pp']:,} | {cf.get('outer_sync') or 0:,.0f} |")
    c = next(row["clock"] for row in result["replicas"].values() if "clock" in row)
    pipe, tbf = c["clock_step_s"], c["clock_tbf_step_s"]
    lines += ["", f"Replica 1's model clock, its plan priced at its ranks' own CPU seconds ({c['compute_step_s']:.3f} "
              f"s of compute) and its stage messages at the link's rate: plain pipe {pipe['full_overlap']:.3f} / "
              f"{pipe['no_overlap']:.3f} s, tbf's bucket {tbf['full_overlap']:.3f} / {tbf['no_overlap']:.3f} s "
              "(full / no overlap)."]
    if "streaming_delay" in result:  # the streaming sync and / or a host lost and regained
        from nanotron_ext.sparseloco.ft_hosts_fault import render_fault

        lines += render_fault(result)
    if result["processes"] > (result["cores"] or 0):
        lines += ["", f"{result['processes']} processes on {result['cores']} cores: the measured steps time the "
                  "oversubscription, not a machine; the comparison with the clock's bounds needs at least as many "
                  "cores as processes. This is a functional run: its results are the losses and the bytes per tier."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
