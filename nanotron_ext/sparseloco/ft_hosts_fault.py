"""A host lost and regained in the three-tier job on namespaced hosts (ft_hosts --kill-host N --kill-at-step S), and
the process helpers the cross-host fault tests share (tests/test_ft_cross_host.py): pacing a live replica with
SIGSTOP / SIGCONT, reading heals and joins from the logs.

The fault: once the killed host's replica has logged step S and holds a checkpoint on every one of its hosts, host N
is killed (SIGKILL to everything in its namespace: mid inner step); the replica's other host's job ends on its own
(torchrun's static rendezvous lost a node). Every host of that replica is relaunched; it resumes its per-host
checkpoints and rejoins, each rank healed from its peer rank of the other replica (torchft). The live replica is
paced (still a member of every quorum) until the relaunched one asks for its first quorum, so it is still training
then: the run has a rejoin, not a replica that finished alone. Host 0 also serves the lighthouse: killed, the other
replica waits for it (said in its log) and the relaunch brings a new one.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

from nanotron_ext.bench.multi_host import JobFailed, last_line, wait_job

Starter = Callable[[int, str], subprocess.Popen]  # (host, log tag) -> that host's launcher


def tree(pid: int) -> List[int]:
    """`pid` and every process below it (torchrun starts its workers in sessions of their own)."""
    parents: Dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        found += frontier
    return found


def signal_tree(pids: Union[int, List[int]], sig: int) -> None:
    for p in [q for pid in ([pids] if isinstance(pids, int) else pids) for q in tree(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def pace(pid: Union[int, List[int]], until: Callable[[], bool], stop_s: float = 2.5, run_s: float = 0.25) -> None:
    """Run the job(s) under `pid` in short spells (SIGSTOP / SIGCONT) until `until()`: a slower machine, still a
    member of every quorum (each pause shorter than the lighthouse's heartbeat timeout). A tiny model's inner loop
    takes a fraction of a second, a replica's (re)start tens: paced, the live replica is still training when the
    other is up. Pausing a process changes nothing it computes."""
    try:
        while not until():
            signal_tree(pid, signal.SIGSTOP)
            deadline = time.monotonic() + stop_s
            while time.monotonic() < deadline and not until():
                time.sleep(0.05)
            signal_tree(pid, signal.SIGCONT)
            time.sleep(run_s)
    finally:
        signal_tree(pid, signal.SIGCONT)


def heals(log: str, replica: int) -> List[Tuple[int, str, int]]:
    """(rank, the peer's recovery server, bytes) of every heal of `replica`'s ranks said in a log."""
    return [(int(m[1]), m[2], int(m[3])) for m in
            re.finditer(rf"replica {replica} rank (\d+) healed from (\S+): (\d+) bytes", log)]


def joins(log: str, replica: int) -> List[int]:
    """The outer syncs at which `replica` joined by a heal (each the one after the state it took), in order."""
    return [int(m[1]) + 1 for m in
            re.finditer(rf"replica {replica} took the global weights and outer state of outer sync (\d+)", log)]


def started_quorum(log: Path, replica: int) -> bool:
    return log.is_file() and f"[Replica sparseloco_{replica}] Start quorum" in log.read_text(errors="replace")


def kill_and_relaunch(hosts: Any, start: Starter, host: int, at_step: int, run_dirs: Dict[int, Path],
                      ckpt_dirs: Dict[int, List[Path]], logs: Path, timeout_s: float) -> Dict[str, Any]:
    """The whole faulted run (module docstring): returns the membership schedule read from the logs. `start(h,
    tag)` starts host h's launcher with its log at logs/host{h}_{tag}.log; `run_dirs` / `ckpt_dirs`: per replica,
    its metrics folder and the checkpoint folders of its hosts."""
    from nanotron_ext.metrics.logger import read_metrics
    from nanotron_ext.train.checkpoint import list_checkpoints

    def steps(replica: int) -> List[int]:
        metrics = run_dirs[replica] / "metrics.jsonl"
        return [r["step"] for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []

    def log(h: int, tag: str) -> Path:
        return logs / f"host{h}_{tag}.log"

    lost = 0 if host == 0 else 1  # the replica on the killed host
    mine = [0] if lost == 0 else [1, 2]  # the hosts that replica runs on (all relaunched: a static rendezvous)
    deadline = time.monotonic() + timeout_s
    # replica 0 first, its first quorum formed, then replica 1, replica 0 paced until replica 1 asks for a quorum:
    # every state replica 1 takes at its join is replica 0's (as tests/test_ft_cross_host.py starts them)
    procs = {0: start(0, "a")}
    _wait(lambda: "Quorum!" in log(0, "a").read_text(errors="replace"), procs, log(0, "a"), deadline)
    procs.update({h: start(h, "a") for h in (1, 2)})
    pace(_live_job(procs, 1, logs), lambda: started_quorum(log(1, "a"), 1) or procs[1].poll() is not None)
    _wait(lambda: max(steps(lost), default=0) >= at_step and all(list_checkpoints(d, []) for d in ckpt_dirs[lost]),
          procs, log(mine[0], "a"), deadline)
    hosts.kill_host(host)  # mid inner step: step S is logged, S + 1 running
    killed_in = max(steps(lost))
    for h in mine:
        try:
            procs[h].wait(180)  # the killed host's, and its partner's (its rendezvous lost a node)
        except subprocess.TimeoutExpired:
            raise JobFailed(f"host {h}'s job outlived the kill of host {host} by 180 s: "
                            f"{last_line(log(h, 'a'))}") from None
        procs[h].log.close()  # type: ignore[attr-defined]
    before = {r: len(steps(r)) for r in (0, 1)}
    procs.update({h: start(h, "b") for h in mine})
    job = _live_job(procs, lost, logs)
    pace(job, lambda: started_quorum(log(mine[0], "b"), lost) or any(procs[h].poll() is not None for h in mine))
    codes = wait_job(list(procs.values()), max(60.0, deadline - time.monotonic()))
    if any(getattr(p, "timed_out", False) for p in procs.values()) or any(codes):
        raise JobFailed(f"after the relaunch of host {host} the job failed (exit codes {codes}): "
                        f"{last_line(log(mine[0], 'b'))}")
    text = {f"host{h}_{t}": log(h, t).read_text(errors="replace") for h in range(3) for t in "ab"
            if log(h, t).is_file()}
    lost_logs = "\n".join(text.get(f"host{h}_b", "") for h in mine)
    resumed = re.search(r"resumed from (\S+) at step (\d+)", lost_logs)
    lighthouse = "\n".join(text.get(f"host0_{t}", "") for t in "ab")
    return {"quorums": quorums(lighthouse), "killed_host": host, "lost_replica": lost, "relaunched_hosts": mine,
            "killed_in_step": killed_in + 1,
            "resumed_at_step": int(resumed[2]) if resumed else 0,
            "steps_logged_before_relaunch": before,
            "joins": {r: joins("\n".join(text.values()), r) for r in (0, 1)},
            # every heal said, per rank: one per join when all of a replica's ranks healed
            "heals": {r: sorted(h for t in text.values() for h in heals(t, r)) for r in (0, 1)},
            "retries": {r: len(re.findall(rf"replica {r}: outer sync \d+ attempt \d+ failed",
                                          "\n".join(text.values()))) for r in (0, 1)},
            "lighthouse_waits": sum(t.count("waiting for the torchft lighthouse") for t in text.values()),
            # a heal that failed on some of a replica's ranks (its peer gone mid-transfer) leaves the others healed:
            # the replica's ranks then train on from different states unless a later quorum heals them all again
            "recovery_failures": sorted({m[1].strip() for t in text.values()
                                         for m in re.finditer(r"got exception in recovery: ([^\n]{0,160})", t)})}


def _wait(done: Callable[[], bool], procs: Dict[int, subprocess.Popen], log: Path, deadline: float) -> None:
    while not done():
        ended = [h for h, p in procs.items() if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise JobFailed(f"host {ended} ended before the fault, or --timeout-s passed: {last_line(log)}")
        time.sleep(0.05)


def quorums(lighthouse_log: str) -> List[Dict[str, int]]:
    """Every quorum the torchft lighthouse formed, in order: {replica: its torchft step (committed syncs)}."""
    out = []
    for line in lighthouse_log.splitlines():
        if "Quorum!" in line:
            out.append({int(m[1]): int(m[2]) for m in
                        re.finditer(r'replica_id: "sparseloco_(\d+)[^"]*"[^}]*?step: (\d+)', line)})
    return out


def _live_job(procs: Dict[int, subprocess.Popen], lost: int, logs: Path) -> Union[int, List[int]]:
    """What to pace: replica 0's job under host 0's ft_launch (not its lighthouse), or replica 1's launchers."""
    if lost == 0:
        return [procs[1].pid, procs[2].pid]
    m = re.search(r"replica 0: pid (\d+)", (logs / "host0_a.log").read_text(errors="replace"))
    if m is None:
        raise JobFailed(f"host 0's log names no replica 0 job: {last_line(logs / 'host0_a.log')}")
    return int(m[1])


def nothing_lost(losses: Dict[int, Dict[int, float]], steps: int) -> Dict[int, Sequence[int]]:
    """Per replica, the steps 1..`steps` it has no loss for (empty: every step trained)."""
    return {r: [s for s in range(1, steps + 1) if s not in got] for r, got in losses.items()}


def streaming_clock(row: Dict[str, Any], mbps: float, inner: int, delay: int) -> Dict[str, Any]:
    """Replica 1's clock bounds (its plain-pipe plan, row["clock"]) with the outer sync added: its wire seconds are
    the replica's torchft payload bytes of one sync (the ledger's, every rank's) over one host link at `mbps` (an
    upper estimate: its two hosts' links each carry a part). Blocking: the sync stops the replica (no-overlap bound
    plus sync / H; full overlap hides it behind the H inner steps); streaming: hidden only behind tau inner steps
    (bench/clock/replay.py's rule, the bound a streaming system is held to)."""
    from types import SimpleNamespace

    from nanotron_ext.bench.clock import with_outer_sync  # the clock's amortisation, not a copy of it

    pipe = row["clock"]["clock_step_s"]
    outer_s = row["ledger_sync_extra_bytes"]["ft"] * 8 / (mbps * 1e6)
    work = [SimpleNamespace(outer_s=[outer_s], control_s=[])]
    blocking = with_outer_sync(work, inner, pipe["full_overlap"], pipe["no_overlap"])
    out = {"outer_sync_wire_s": outer_s, "blocking": {"full_overlap": blocking.lower_s,
                                                      "no_overlap": blocking.upper_s}}
    if delay:
        tau = with_outer_sync(work, inner, pipe["full_overlap"], pipe["no_overlap"], delay)
        out["streaming_tau"] = {"delay": delay, "full_overlap_behind_tau": tau.lower_s + tau.agreements_s}
    return out


def render_fault(result: Dict[str, Any]) -> List[str]:
    """The markdown lines ft_hosts adds for the streaming sync, the clock's bounds with it and a lost host."""
    tau, rows = result["streaming_delay"], result["replicas"]
    sync = rows["1"]["clock"]["outer_sync"] if "1" in rows else rows[1]["clock"]["outer_sync"]
    block = sync["blocking"]
    lines = ["", f"Outer sync: {'streaming, tau = %d, alpha = %g' % (tau, result['alpha']) if tau else 'blocking'}. "
             f"With replica 1's sync on the wire ({sync['outer_sync_wire_s'] * 1e3:.1f} ms: its ledger's torchft bytes "
             f"of a sync over one host link, an upper estimate), the clock's bounds per step: blocking "
             f"{block['full_overlap']:.3f} / {block['no_overlap']:.3f} s (full / no overlap)"
             + (f", streaming behind tau = {tau}: {sync['streaming_tau']['full_overlap_behind_tau']:.3f} s" if tau
                else "") + ". Measured per step over a cycle (from the median inner and sync steps; each launch's "
             "first step left out): " + ", ".join(f"replica {r} {row['cycle_step_s']:.3f} s" for r, row in rows.items())
             + ". Oversubscribed (below): these times are no hardware claim."]
    sch = result.get("schedule")
    if sch:
        lost = sch["lost_replica"]
        lines += ["", "The lighthouse's quorums in order (replica@its torchft step, i.e. syncs committed): "
                  + "; ".join(", ".join(f"r{r}@{st}" for r, st in sorted(q.items())) for q in sch["quorums"]) + "."]
        lines += ["", f"Membership schedule: host {sch['killed_host']} killed during replica {lost}'s step "
                  f"{sch['killed_in_step']}; hosts {sch['relaunched_hosts']} relaunched, replica {lost} resumed its "
                  f"checkpoint at step {sch['resumed_at_step']}. Joins by a heal (the outer sync joined): "
                  + "; ".join(f"replica {r}: {j or 'none'}" for r, j in sch["joins"].items())
                  + ". Heals (rank, peer's recovery server, bytes): "
                  + "; ".join(f"replica {r}: {h or 'none'}" for r, h in sch["heals"].items())
                  + f". Failed sync attempts retried: {sch['retries']}; waits for the lighthouse said: "
                  f"{sch['lighthouse_waits']}. The live replica was paced (SIGSTOP / SIGCONT) while the other "
                  "started and while it was relaunched: its step times include those pauses."]
        if sch["recovery_failures"]:
            lines += ["", "**A heal failed on some ranks** (their replica's ranks may hold different states after "
                      "it): " + "; ".join(sch["recovery_failures"])]
    missing = {r: m for r, m in result["missing_steps"].items() if m}
    lines += ["", "Nothing lost: every replica has a loss for every step 1.." + str(result["steps"]) + "."
              if not missing else f"Steps without a loss: {missing}."]
    for r, row in rows.items():
        lines.append(f"- replica {r} losses: " + ", ".join(f"{x:.4f}" for x in row["losses"])
                     + (" (replayed after the relaunch, first tries: "
                        + ", ".join(f"{s}: {x:.4f}" for s, x in row["replayed"].items()) + ")"
                        if row["replayed"] else ""))
    lines += ["", f"Reference: {result['reference']}."]
    return lines
