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
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.bench.multi_host import REPO, JobFailed, clock_for, last_line, launcher_argv, wait_job
from nanotron_ext.bench.netns_hosts import Hosts

EXAMPLE = REPO / "examples" / "config_three_tiers.yaml"
RUN = "ft_three_tiers"
PROCESSES = 8  # two replicas of tp 2 x pp 2
GROUPS = ("tp", "pp", "ft")  # the comm ledger's groups: TP, the stage link, torchft's outer sync


def job_sets(lighthouse: str, disk_at: Path, steps: int, inner: int) -> List[str]:
    return ["sparseloco.fault_tolerance.enabled=true", f"sparseloco.fault_tolerance.lighthouse={lighthouse}",
            "sparseloco.fault_tolerance.replicas=2", "sparseloco.fault_tolerance.min_replicas=2",
            "sparseloco.compressed_replicas=[1]", "parallelism.dp=1", "parallelism.link.enabled=false",
            f"sparseloco.inner_steps={inner}", f"tokens.train_steps={steps}", f"tokens.val_check_interval={steps}",
            "checkpoints.interval=0", "checkpoints.storage=per_host", f"checkpoints.dir={disk_at}/ckpt",
            f"general.output_dir={disk_at}/runs", "logging.progress_bar=false", "logging.rank_cpu_seconds=true",
            f"general.run={RUN}"]


def wan_sets(sets: Sequence[str], disk_at: Path) -> List[str]:
    return [*sets, "sparseloco.fault_tolerance.replica=1", f"general.run={RUN}_r1",
            f"checkpoints.dir={disk_at}/ckpt_r1"]


def run_job(hosts: Hosts, sets: List[str], disk_at: Path, logs: Path, timeout_s: float) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", "--config-file", str(EXAMPLE), "--replicas",
            "0", "--nproc_per_node", "4", "--max-restarts", "0", *[x for s in sets for x in ("--set", s)]]
    procs = []
    for h, cmd in ((0, argv), *((h, launcher_argv(EXAMPLE, h - 1, 2, hosts.addr(1), wan_sets(sets, disk_at), nproc=2))
                                for h in (1, 2))):
        out = open(logs / f"host{h}.log", "w")  # noqa: SIM115 - closed by wait_job
        procs.append(hosts.popen(h, cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
        procs[-1].log = out  # type: ignore[attr-defined]
    codes = wait_job(procs, timeout_s)
    if any(getattr(p, "timed_out", False) for p in procs) or any(codes):
        raise JobFailed(f"the job failed (exit codes {codes}; logs in {logs}): {last_line(logs / 'host0.log')} | "
                        f"{last_line(logs / 'host1.log')}")


def replica_row(run_dir: Path, inner: int, closed: Dict[str, Optional[float]]) -> Dict[str, Any]:
    """Losses, inner and sync step times (step 1 left out), and per tier the ledger's bytes of an inner step beside
    the closed form, and what a sync step adds (the SparseLoCo payload gather, ft; the embedding fold, tp and pp)."""
    import json

    from nanotron_ext.metrics.logger import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    inner_s = [r["step_time_s"] for r in records[1:] if r["step"] % inner]
    sync_s = [r["step_time_s"] for r in records[1:] if not r["step"] % inner]
    one = next(r["comm_bytes"] for r in records[1:] if r["step"] % inner)
    sync = next(r["comm_bytes"] for r in records if not r["step"] % inner)
    wire = one.get("pp:send:fwd", 0) + one.get("pp:send:bwd", 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"losses": [r["loss"] for r in records], "final_val_loss": summary.get("final_val_loss"),
            "inner_step_s": statistics.median(inner_s) if inner_s else None,
            "sync_step_s": statistics.median(sync_s) if sync_s else None,
            "ledger_inner_step_bytes": {"tp": one.get("tp", 0), "pp": one.get("pp", 0), "pp_wire": wire},
            "ledger_sync_extra_bytes": {g: sync.get(g, 0) - one.get(g, 0) for g in GROUPS},
            "closed_form_bytes_per_step": closed}


def closed_forms(sets: Sequence[str]) -> Dict[str, Optional[float]]:
    """Bytes per step per tier (config/tiers.py), and one outer sync's payload (SparseLoCo's closed form: the
    unsharded model's tensors; each TP rank compresses its own shards, so the ledger reads more)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step
    from nanotron_ext.sparseloco import technique

    cfg = load_config(str(EXAMPLE), list(sets))
    sync = technique.closed_form_bytes("parallelism.dp_sync", "sparseloco", cfg)
    return {**job_bytes_per_step(cfg), "outer_sync": sync.forward * cfg.sparseloco.inner_steps}


def measure(rate: str, mbps: float, steps: int, inner: int, work: Path, timeout_s: float) -> Dict[str, Any]:
    disk_at, disks = work / "disk", work / "hosts"
    shutil.rmtree(disks, ignore_errors=True)  # empty disks: a finished run would only be reported again
    with Hosts(3, rate=rate, disk_root=disks, disk_at=disk_at) as hosts:
        sets = job_sets(f"http://{hosts.addr(0)}:29510", disk_at, steps, inner)
        run_job(hosts, sets, disk_at, work / "logs", timeout_s)
        runs = {0: hosts.disk(0) / "runs" / f"{RUN}_r0", 1: hosts.disk(1) / "runs" / f"{RUN}_r1"}
        rows = {r: replica_row(d, inner, closed_forms([*sets, f"sparseloco.fault_tolerance.replica={r}"]))
                for r, d in runs.items()}
        # the planner builds no torchft sync: its twin is the same replica as the only one of a plain run
        twin = [*wan_sets(sets, disk_at), "sparseloco.fault_tolerance.enabled=false",
                "sparseloco.compressed_replicas=[0]"]
        rows[1]["clock"] = clock_for(EXAMPLE, twin, runs[1], mbps, work / "plans")
    return {"replicas": rows, "rate_mbps": mbps, "steps": steps, "inner_steps": inner,
            "cores": os.cpu_count(), "processes": PROCESSES}


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
    args = parser.parse_args(argv)
    why = available()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rate = f"{args.mbps:g}mbit"
    try:
        result = measure(rate, rate_bits_per_s(rate) / 1e6, args.steps, args.inner_steps, Path(args.work).resolve(),
                         args.timeout_s)
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
    if result["processes"] > (result["cores"] or 0):
        lines += ["", f"{result['processes']} processes on {result['cores']} cores: the measured steps time the "
                  "oversubscription, not a machine; the comparison with the clock's bounds needs at least as many "
                  "cores as processes. This is a functional run: its results are the losses and the bytes per tier."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
