"""A fault-tolerant replica that is itself a job across hosts (issue 52 item 3): network namespaces stand for three
hosts (bench/netns_hosts). Replica 1 is a pipeline of two stages, one per host (hosts 1 and 2, one
`nanotron_ext.launch --nnodes 2` each), its boundary through the subspace codec on their link; replica 0, the
datacenter replica, is the same two stages uncompressed on host 0, which also serves the torchft lighthouse. Host 2
is killed in the middle of an inner step: replica 0 trains on alone, both of replica 1's hosts are relaunched,
resume their own per-host checkpoints and rejoin; each of replica 1's ranks heals from its peer rank of replica 0
(torchft: every rank its own manager client with its group rank). The reference is the simulated driver's pieces in
one process (whole models, no torchft, no pipeline) given the membership schedule the run had: replica 1 joining
(without a payload, taking the global weights, T_fixed and zero error feedback) at the syncs its logs name, absent
from the sync it died before up to its rejoin, then training on from its checkpoint's step. Every loss of every
replica equals the reference's, bit for bit. Replica 0 starts first (its first sync done before replica 1 is
launched), so every state replica 1 ever takes is replica 0's, rank by rank. The inner optimiser is stateless
(AdamW with betas 0, a constant lr) so that only the weights and the data position carry a replica across its
restart. Needs root and namespaces: skipped otherwise."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from nanotron_ext.bench.multi_host import REPO, last_line, launcher_argv
from nanotron_ext.bench.netns_hosts import Hosts, available
from nanotron_ext.metrics.logger import read_metrics
from nanotron_ext.sparseloco.ft_hosts_fault import heals, pace
from nanotron_ext.train.checkpoint import list_checkpoints
from tests.conftest import SMALL_VOCAB

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
pytest.importorskip("torchft")

EXAMPLE = REPO / "examples" / "config_tiny_ft_two_hosts.yaml"
H, STEPS = 6, 120  # replica 1 dies in its second inner loop, after its checkpoint at its step H
RUN = "tiny_ft_two_hosts"
WAN = 1  # the replica across hosts


def model_sets(corpus: Path) -> List[str]:
    """The tiny job (replica 1 compressed at the boundary after layer 0: its stage end at pp = 2, and the same
    boundary in the one-process reference)."""
    return [f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}", "model.hidden_size=32",
            "model.ffn_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
            "model.codec.boundaries=[0]", "model.subspace.k=8", "tokens.sequence_length=16",
            "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1", f"tokens.train_steps={STEPS}",
            f"tokens.val_check_interval={STEPS}", "tokens.val_steps=1", "optimizer.warmup_steps=0",
            "optimizer.decay=constant", "optimizer.betas=[0.0,0.0]", f"sparseloco.inner_steps={H}",
            "sparseloco.chunk=256", "sparseloco.topk=16", "sparseloco.index_bits=8"]


def job_sets(hosts: Hosts, corpus: Path, disk_at: Path) -> List[str]:
    return [*model_sets(corpus), f"sparseloco.fault_tolerance.lighthouse=http://{hosts.addr(0)}:29510",
            f"checkpoints.dir={disk_at}/ckpt", f"general.output_dir={disk_at}/runs", "logging.progress_bar=false",
            "checkpoints.storage=per_host", f"checkpoints.interval={H}"]


LIGHTHOUSE = ("import sys, time\nfrom torchft.coordination import LighthouseServer\n"
              "s = LighthouseServer(bind=sys.argv[1], min_replicas=1, join_timeout_ms=5000, quorum_tick_ms=50, "
              "heartbeat_timeout_ms=5000)\nprint('lighthouse at', s.address(), flush=True)\ntime.sleep(3600)")


def start_lighthouse(hosts: Hosts, log: Path) -> subprocess.Popen:
    """Host 0's torchft lighthouse (a replica is a member until 5 s after its last heartbeat)."""
    return hosts.popen(0, [sys.executable, "-c", LIGHTHOUSE, f"{hosts.addr(0)}:29510"], stdout=open(log, "w"),
                       stderr=subprocess.STDOUT, cwd=REPO)


def start_datacenter(hosts: Hosts, sets: List[str], log: Path) -> subprocess.Popen:
    """Host 0: replica 0, both stages on this host (2 processes), its job in its own process group."""
    argv = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", "--config-file", str(EXAMPLE), "--replicas",
            "0", "--nproc_per_node", "2", "--max-restarts", "0", "--no-lighthouse"]
    for s in sets:
        argv += ["--set", s]
    return hosts.popen(0, argv, env={"OMP_NUM_THREADS": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                       cwd=REPO)


def start_wan_replica(hosts: Hosts, sets: List[str], disk_at: Path, logs: Path, tag: str) -> List[subprocess.Popen]:
    """Hosts 1 and 2: replica 1, a stage per host (static rendezvous at host 1; torchft's store is torchrun's). The
    trainer's link emulator adds a WAN latency (this kernel has no netem), so a kill lands inside an inner loop."""
    mine = [*sets, f"sparseloco.fault_tolerance.replica={WAN}", f"general.run={RUN}_r{WAN}",
            f"checkpoints.dir={disk_at}/ckpt_r{WAN}", "parallelism.link.enabled=true", "parallelism.link.latency_ms=50"]
    return [hosts.popen(h, launcher_argv(EXAMPLE, h - 1, 2, hosts.addr(1), mine), env={"OMP_NUM_THREADS": "1"},
                        stdout=open(logs / f"host{h}_{tag}.log", "w"), stderr=subprocess.STDOUT, cwd=REPO)
            for h in (1, 2)]


def losses(run_dir: Path) -> Dict[int, float]:
    metrics = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(metrics) if "loss" in r} if metrics.is_file() else {}


def wait_for(what: str, done, procs: List[subprocess.Popen], log: Path, timeout_s: float = 600,
             poll_s: float = 0.3) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}: {last_line(log)}"
        assert all(p.poll() is None for p in procs), f"{what}: a launcher ended: {last_line(log)}"
        time.sleep(poll_s)


def quorums(lighthouse_log: Path) -> List[str]:
    """The quorums the lighthouse formed so far (one line each, naming the members)."""
    return [line for line in lighthouse_log.read_text().splitlines() if "Quorum!" in line]


def joined_at(log: str, replica: int = WAN) -> int:
    """The outer sync at which `replica` joined (the one after the state it took)."""
    m = re.search(rf"replica {replica} took the global weights and outer state of outer sync (\d+)", log)
    assert m, log[-3000:]
    return int(m[1]) + 1


def reference(corpus: Path, segments: Dict[int, List[Tuple[int, int, int]]]) -> Dict[str, object]:
    """The simulated driver's pieces in one process (whole models, no torchft). Replica r lives in `segments[r]`
    (join round, its step then, last round it sends in): it joins that round's sync without a payload (taking the
    global weights, the live replica's T_fixed and zero error feedback: what a heal brings; join round 0: the start),
    then trains on from that step and sends from the next round. Per replica {step: loss}; each stage's parameter
    count."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.loader import build_train_loader
    from nanotron_ext.parallel.context import standalone_context
    from nanotron_ext.sparseloco.simulate import outer_loop
    from nanotron_ext.train.replica import Replica

    cfg = load_config(EXAMPLE, [*model_sets(corpus), "parallelism.dp=2", "parallelism.pp=1",
                                "sparseloco.fault_tolerance.enabled=false"])
    ctx = standalone_context(backend="gloo")
    reps = [Replica(cfg, ctx, r, local=True) for r in range(2)]
    sim = outer_loop(cfg, reps)
    hubs = sim.hooks[0].hubs
    loaders = [build_train_loader(cfg, dp_rank=r, dp_size=2, config_file=str(EXAMPLE)) for r in range(2)]
    step = [0, 0]
    out: Dict[int, Dict[int, float]] = {0: {}, 1: {}}

    def train(r: int) -> None:
        for _ in range(H):
            step[r] += 1
            loss = reps[r].backward([next(loaders[r])])
            reps[r].update(step[r], loss.item())
            out[r][step[r]] = float(loss)

    for n in range(1, 10_000):
        training = [r for r in (0, 1) if step[r] < STEPS and any(a < n <= b for a, _, b in segments[r])]
        joiners = [r for r in (0, 1) if any(a == n for a, _, _ in segments[r])]
        if not training and not joiners:
            break
        for r in joiners:  # a (re)joining replica trains on from its own step (its checkpoint's)
            step[r] = next(at for a, at, _ in segments[r] if a == n)
            hubs[r].fixed.copy_(hubs[1 - r].fixed)  # the heal brings T_fixed as the live peer holds it
        for r in training:
            train(r)
        payloads = []
        for r in training:
            for hook in sim.hooks:
                hook(r, sim.params[r], "before_encode")
            payloads.append(sim.outer.encode(sim.params[r], sim.errors[r]))
        sim.outer.apply(payloads)
        for hook in sim.hooks:
            hook(-1, sim.outer.global_params, "after_apply")
        for r in joiners:
            for e in sim.errors[r]:
                e.zero_()
        for r in training + joiners:
            sim.outer.load_into(sim.params[r])
            for hook in sim.hooks:
                hook(r, sim.params[r], "after_sync")
    stages = [sum(p.numel() for name, p in reps[0].model.named_parameters()
                  if name.startswith(("token_embedding.", "decoder.0.")) == (s == 0)) for s in (0, 1)]
    return {"losses": out, "stages": stages}


def start_both(hosts: Hosts, sets: List[str], disk_at: Path, tmp_path: Path, latency0: bool = False
               ) -> Tuple[subprocess.Popen, List[subprocess.Popen], int]:
    """The lighthouse and replica 0 on host 0; once replica 0 joined alone (the run's first state is its own),
    replica 1 on hosts 1 and 2, replica 0 paced (still a member) until replica 1 asks for its first quorum.
    Returns replica 0's launcher, replica 1's two and the process id over replica 0's job."""
    start_lighthouse(hosts, tmp_path / "lighthouse.log")
    lat = ["parallelism.link.enabled=true", "parallelism.link.latency_ms=50"] if latency0 else []
    dc = start_datacenter(hosts, sets + lat, tmp_path / "host0.log")
    wait_for("replica 0's first quorum", lambda: "Quorum!" in (tmp_path / "lighthouse.log").read_text(), [dc],
             tmp_path / "host0.log", poll_s=0.02)
    job0 = int(re.search(r"replica 0: pid (\d+)", (tmp_path / "host0.log").read_text())[1])
    wan = start_wan_replica(hosts, sets, disk_at, tmp_path, "a")
    pace(job0, lambda: f"[Replica sparseloco_{WAN}] Start quorum" in (tmp_path / "host1_a.log").read_text())
    return dc, wan, job0


def test_a_two_host_replica_loses_a_host_mid_step_rejoins_and_heals_rank_by_rank(tmp_path: Path,
                                                                                small_corpus: Path) -> None:
    disk_at = tmp_path / "disk"
    logs = {h: tmp_path / f"host{h}_a.log" for h in (1, 2)}
    with Hosts(3, rate="200mbit", disk_root=tmp_path / "hosts", disk_at=disk_at) as hosts:
        sets = job_sets(hosts, small_corpus, disk_at)
        dc, wan, job0 = start_both(hosts, sets, disk_at, tmp_path)
        run0 = hosts.disk(0) / "runs" / f"{RUN}_r0"
        run1 = hosts.disk(1) / "runs" / f"{RUN}_r{WAN}"
        # replica 1's checkpoint at its step H on both of its hosts, and its step H + 1 logged
        wait_for("replica 1's step H + 1", lambda: all(list_checkpoints(hosts.disk(h) / f"ckpt_r{WAN}", [])
                                                       for h in (1, 2)) and max(losses(run1), default=0) > H,
                 [dc, *wan], logs[1], poll_s=0.05)
        hosts.kill_host(2)  # replica 1's second stage dies mid inner step
        killed_in = max(losses(run1))
        assert wan[0].wait(120) != 0, last_line(logs[1])  # its first stage's job ends, said
        first = {h: logs[h].read_text() for h in (1, 2)}
        # the kill landed in the inner loop: replica 1 committed its join and one outer sync only
        assert killed_in <= 2 * H - 2 and first[1].count("should_commit completed should_commit=true") == 2, killed_in
        wan = start_wan_replica(hosts, sets, disk_at, tmp_path, "b")  # both hosts back
        before = len(quorums(tmp_path / "lighthouse.log"))
        wait_for("replica 0's sync alone", lambda: any(f"sparseloco_{WAN}" not in q for q in
                                                       quorums(tmp_path / "lighthouse.log")[before:]),
                 [dc], tmp_path / "host0.log")
        pace(job0, lambda: f"[Replica sparseloco_{WAN}] Start quorum" in (tmp_path / "host1_b.log").read_text())
        codes = [p.wait(600) for p in [dc, *wan]]
        again = {h: (tmp_path / f"host{h}_b.log").read_text() for h in (1, 2)}
        assert codes == [0, 0, 0], (codes, last_line(tmp_path / "host0.log"), last_line(tmp_path / "host1_b.log"))
        assert f"resumed from {disk_at}/ckpt_r{WAN}/step_{H}" in again[1], again[1][-2000:]
        joins = [joined_at(first[1]), joined_at(again[1])]
        r0, r1 = losses(run0), losses(run1)
        host0 = hosts.addr(0)
    assert joins[1] >= joins[0] + 3, joins  # replica 0 synced alone (at least the sync replica 1 died before)
    ref = reference(small_corpus, {0: [(0, 0, 10_000)], WAN: [(joins[0], 0, joins[0] + 1), (joins[1], H, 10_000)]})
    # both joins: every rank healed once, from a recovery server of the datacenter host (one per stage), and
    # received that stage's fp32 weights plus T_fixed (V x d)
    for run in (first, again):
        got = sorted(heals(run[1], WAN) + heals(run[2], WAN))
        assert [g[0] for g in got] == [0, 1] and len({g[1] for g in got}) == 2, got
        assert all(f"//{host0}:" in g[1] for g in got), got
        assert [g[2] for g in got] == [(n + SMALL_VOCAB * 32) * 4 for n in ref["stages"]], (got, ref["stages"])
    # nothing lost: every step of each replica, equal to the reference's for this membership schedule
    assert sorted(r0) == list(range(1, STEPS + 1)) == sorted(r1), (sorted(r0), sorted(r1))
    for r, run in ((0, r0), (WAN, r1)):  # bit for bit: the same ops in the same order, pipeline or not
        assert run == ref["losses"][r], (r, {s: (x, ref["losses"][r][s]) for s, x in run.items()
                                             if x != ref["losses"][r][s]})


def test_the_datacenter_host_dies_with_the_lighthouse_and_rejoins_healed_rank_by_rank_across_hosts(
        tmp_path: Path, small_corpus: Path) -> None:
    """Host 0, the datacenter replica and the lighthouse, is killed in the middle of replica 0's inner step: replica
    1 waits for the lighthouse, saying so, and trains on alone once host 0 is relaunched (a new lighthouse, replica
    0 resuming its checkpoint); replica 0 rejoins, each of its ranks healed from its peer rank of the pipeline
    across hosts (stage 0 from host 1, stage 1 from host 2). Both replicas' losses equal the reference's."""
    disk_at = tmp_path / "disk"
    with Hosts(3, rate="200mbit", disk_root=tmp_path / "hosts", disk_at=disk_at) as hosts:
        sets = job_sets(hosts, small_corpus, disk_at)
        dc, wan, _ = start_both(hosts, sets, disk_at, tmp_path, latency0=True)
        run0 = hosts.disk(0) / "runs" / f"{RUN}_r0"
        run1 = hosts.disk(1) / "runs" / f"{RUN}_r{WAN}"
        # replica 1 took part in a sync; then replica 0 one step into an inner loop
        wait_for("replica 1's step H + 1", lambda: max(losses(run1), default=0) > H, [dc, *wan],
                 tmp_path / "host1_a.log")
        wait_for("replica 0's first inner step", lambda: max(losses(run0)) % H == 1, [dc, *wan],
                 tmp_path / "host0.log", poll_s=0.02)
        hosts.kill_host(0)  # the datacenter replica and the lighthouse
        killed_in = max(losses(run0))
        assert dc.wait(60) != 0 and 1 <= killed_in % H <= H - 2, killed_in  # it died inside its inner loop
        saved = killed_in - killed_in % H
        wait_for("replica 1 waiting for the lighthouse", lambda: "waiting for the torchft lighthouse" in
                 (tmp_path / "host1_a.log").read_text(), wan, tmp_path / "host1_a.log")
        start_lighthouse(hosts, tmp_path / "lighthouse_b.log")
        dc = start_datacenter(hosts, sets, tmp_path / "host0_b.log")
        wait_for("replica 1's sync alone", lambda: quorums(tmp_path / "lighthouse_b.log"), wan,
                 tmp_path / "host1_a.log")
        back = tmp_path / "host0_b.log"
        pace([p.pid for p in wan], lambda: "[Replica sparseloco_0] Start quorum" in back.read_text())
        codes = [p.wait(600) for p in [dc, *wan]]
        back, log1 = back.read_text(), (tmp_path / "host1_a.log").read_text()
        assert codes == [0, 0, 0], (codes, last_line(tmp_path / "host0_b.log"), last_line(tmp_path / "host1_a.log"))
        assert f"resumed from {disk_at}/ckpt_r0/step_{saved}" in back, back[-2000:]
        assert "answers again" in log1, log1[-2000:]
        joins = {0: joined_at(back, 0), WAN: joined_at(log1)}
        r0, r1 = losses(run0), losses(run1)
        addr = [hosts.addr(h) for h in range(3)]
    assert joins[0] > saved // H + 1, (joins, saved)  # replica 1 synced alone at least once
    ref = reference(small_corpus, {0: [(0, 0, saved // H), (joins[0], saved, 10_000)],
                                   WAN: [(joins[WAN], 0, 10_000)]})
    # replica 0's ranks healed from replica 1's, each from its own stage's host, that stage's weights and T_fixed
    got = sorted(set(heals(back, 0)))
    assert [(rank, f"//{addr[rank + 1]}:" in src) for rank, src, _ in got] == [(0, True), (1, True)], got
    assert [n for _, _, n in got] == [(n + SMALL_VOCAB * 32) * 4 for n in ref["stages"]], (got, ref["stages"])
    assert sorted(r0) == list(range(1, STEPS + 1)) == sorted(r1), (sorted(r0), sorted(r1))
    for r, run in ((0, r0), (WAN, r1)):
        assert run == ref["losses"][r], (r, {s: (x, ref["losses"][r][s]) for s, x in run.items()
                                             if x != ref["losses"][r][s]})
