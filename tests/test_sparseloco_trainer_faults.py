"""Fault tolerance at the trainer level (issue 33): two replicas of examples/config_tiny_sparseloco_ft.yaml, each a
`python -m nanotron_ext.launch` job (dp = 1), and torchft's own lighthouse binary. A replica killed in its inner
loop, or inside an outer sync, and launched again resumes its checkpoint and takes the current global weights from
the live peer; the survivor trains every step through the gap and never takes anything from the relaunched one.
The lighthouse killed for good ends both replicas with one line naming it (exit 2; not a disk-space hint)."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.helpers.dist import free_port
from tests.helpers.jobs import REPO, wait_for, workers
from tests.test_trainer import _small_overrides

pytest.importorskip("torchft")  # the `ft` extra (in the dev extra that make setup installs)

EXAMPLE = REPO / "examples" / "config_tiny_sparseloco_ft.yaml"
# inner steps, checkpoint interval (after a sync: a multiple of H); the runs are long and stopped with Ctrl-C once
# the relaunched replica has synced with the survivor (a short one ends before the relaunched one has started)
H, EVERY, STEPS = 3, 6, 100000
HEAL = re.compile(r"^sparseloco\.fault_tolerance: replica (\d) took the global weights and outer state of outer sync "
                  r"(\d+) from a live peer$", re.M)


class Job:
    """The lighthouse (torchft_lighthouse) and the replicas' launches, each launch's output in a file of its own."""

    def __init__(self, corpus: Path, out: Path, quorum_timeout_s: int = 60, min_replicas: int = 1) -> None:
        self.out, self.port, self.min_replicas = out, free_port(), min_replicas
        self.url = f"http://127.0.0.1:{self.port}"
        self.sets = _small_overrides(corpus, out, 1, 1, 1, STEPS) + [
            f"sparseloco.inner_steps={H}", "sparseloco.topk=8", f"checkpoints.interval={EVERY}",
            "checkpoints.keep_last=5", f"sparseloco.fault_tolerance.lighthouse={self.url}",
            f"sparseloco.fault_tolerance.min_replicas={min_replicas}", "sparseloco.fault_tolerance.timeout_s=10",
            f"sparseloco.fault_tolerance.quorum_timeout_s={quorum_timeout_s}"]
        self.launches: List[subprocess.Popen] = []
        self.lighthouse = self.start_lighthouse()

    def start_lighthouse(self) -> subprocess.Popen:
        # join timeout: a quorum waits this long for a live replica still in its inner loop (they sync in step)
        return subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind",
                                 f"127.0.0.1:{self.port}", "--min_replicas", str(self.min_replicas),
                                 "--join_timeout_ms", "20000",
                                 "--heartbeat_timeout_ms", "2000"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def launch(self, replica: int, module: str = "nanotron_ext.train", env: Optional[Dict[str, str]] = None
               ) -> subprocess.Popen:
        log = self.out / f"r{replica}_launch{sum(1 for _ in self.out.glob(f'r{replica}_launch*.txt'))}.txt"
        sets = self.sets + [f"sparseloco.fault_tolerance.replica={replica}", f"general.run=ft_r{replica}",
                            f"checkpoints.dir={self.out / f'ckpt_r{replica}'}"]
        cmd = [sys.executable, "-m", "nanotron_ext.launch", "--nproc_per_node=1", "-m", module, "--config-file",
               str(EXAMPLE), *[x for s in sets for x in ("--set", s)]]
        self.out.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        proc.log = log
        self.launches.append(proc)
        return proc

    def steps(self, replica: int) -> List[Dict[str, object]]:
        path = self.out / f"ft_r{replica}" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def close(self) -> None:
        for p in self.launches:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.lighthouse.poll() is None:
            self.lighthouse.kill()
            self.lighthouse.wait()


def _kill_worker(launch: subprocess.Popen) -> None:
    """SIGKILL the replica's training process (a crash, an OOM kill); its launcher then ends by itself."""
    for pid in workers(launch):
        os.kill(pid, signal.SIGKILL)
    launch.wait(timeout=120)


def _until_rejoined(job: Job, relaunch: subprocess.Popen, resumed_at: int) -> None:
    """Wait for the relaunched replica to train two outer syncs past its checkpoint, then stop both (Ctrl-C)."""
    wait_for(lambda: bool(job.steps(1)) and job.steps(1)[-1]["step"] >= resumed_at + 2 * H, relaunch,
             "two outer syncs of the relaunched replica", timeout=240)
    for p in job.launches:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in job.launches:
        p.wait(timeout=120)


def _survivor_trained_every_step(job: Job, replica: int = 0) -> None:
    """Every step from 1 logged exactly once, in order, with a finite loss: no gap, no step trained twice."""
    steps = job.steps(replica)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), [r["step"] for r in steps]
    assert all(math.isfinite(r["loss"]) for r in steps)


def _start(job: Job, **kw: object) -> tuple:
    """Replica 0, then replica 1 once replica 0 trains: replica 0 never takes anything from replica 1 (with
    min_replicas 1 the first to reach a quorum forms it alone; the other joins a later one and heals from it)."""
    r0 = job.launch(0)
    wait_for(lambda: len(job.steps(0)) >= 1, r0, "replica 0's first step", timeout=240)
    return r0, job.launch(1, **kw)


def _rejoined(job: Job, relaunch: subprocess.Popen, resumed_at: int) -> None:
    """The relaunched replica resumed its own checkpoint, then took a later outer sync's state from the live peer;
    the survivor never took anything from the relaunched one (nor from anyone)."""
    out = relaunch.log.read_text()
    assert f"resumed from {job.out / 'ckpt_r1' / f'step_{resumed_at}'} at step {resumed_at}" in out, out[-3000:]
    heals = [(int(r), int(s)) for r, s in HEAL.findall(out)]
    assert len(heals) == 1 and heals[0][0] == 1 and heals[0][1] > resumed_at // H, (heals, out[-3000:])
    survivor = "".join(p.log.read_text() for p in job.launches if p.log.name.startswith("r0_"))
    assert not HEAL.findall(survivor), HEAL.findall(survivor)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_replica_killed_mid_inner_loop_rejoins_from_the_live_peer(small_corpus: Path, tmp_path: Path) -> None:
    """Replica 1 killed after step 7 (its inner loop between the syncs at 6 and 9; a checkpoint at 6) and launched
    again once replica 0 has trained two more steps alone."""
    job = Job(small_corpus, tmp_path)
    try:
        r0, r1 = _start(job)
        wait_for(lambda: len(job.steps(1)) >= 7, r1, "7 steps of replica 1", timeout=240)
        _kill_worker(r1)
        assert r1.returncode != 0
        gap_from = len(job.steps(0))
        wait_for(lambda: len(job.steps(0)) >= gap_from + 2, r0, "replica 0 training alone", timeout=120)
        relaunch = job.launch(1)
        _until_rejoined(job, relaunch, resumed_at=6)
    finally:
        job.close()
    assert r0.returncode == 130 and relaunch.returncode == 130, (r0.returncode, relaunch.returncode)
    _survivor_trained_every_step(job)
    _rejoined(job, relaunch, resumed_at=6)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_replica_killed_mid_sync_is_retried_around_then_rejoins(small_corpus: Path, tmp_path: Path) -> None:
    """Replica 1 dies inside its fourth outer sync (the join, the syncs at 3 and 6, then the one at 9), after the
    quorum that includes it: replica 0's gather fails, it says so and retries with the next quorum (never applies
    half a sync), trains on alone, and replica 1 launched again resumes step 6 and rejoins."""
    job = Job(small_corpus, tmp_path)
    try:
        r0, r1 = _start(job, module="tests.helpers.ft_die_in_sync", env={"FT_DIE_IN_SYNC": "4"})
        assert r1.wait(timeout=300) != 0, r1.log.read_text()[-3000:]
        assert [r["step"] for r in job.steps(1)][-1] == 8  # step 9 ended in the sync it died in
        relaunch = job.launch(1)
        _until_rejoined(job, relaunch, resumed_at=6)
    finally:
        job.close()
    assert r0.returncode == 130 and relaunch.returncode == 130, (r0.returncode, relaunch.returncode)
    retries = re.findall(r"^sparseloco\.fault_tolerance: replica 0: outer sync (\d+) attempt 1 failed \(.+\); "
                         r"retrying with the next quorum$", r0.log.read_text(), re.M)
    assert retries, r0.log.read_text()[-3000:]
    _survivor_trained_every_step(job)
    _rejoined(job, relaunch, resumed_at=6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_replicas_whose_lighthouse_is_killed_end_naming_it(small_corpus: Path, tmp_path: Path) -> None:
    """Row 12: the lighthouse killed while both replicas train (for good): each says it waits for it, then ends
    within the bound (quorum_timeout_s=15) with exit 2 and one line naming it and what to do, never the disk hint
    ("free space there or make it writable") that torchft's TimeoutError used to get."""
    job = Job(small_corpus, tmp_path, quorum_timeout_s=15, min_replicas=2)  # both train, in step
    try:
        launches = [job.launch(0), job.launch(1)]
        wait_for(lambda: all(len(job.steps(r)) >= 4 for r in (0, 1)), launches[0], "4 steps of each", timeout=240)
        job.lighthouse.kill()
        job.lighthouse.wait()
        killed = time.time()
        codes = [p.wait(timeout=120) for p in launches]
        took = time.time() - killed
    finally:
        job.close()
    assert codes == [2, 2] and took < 15 + 60, (codes, took)
    for p in launches:
        out = p.log.read_text()
        ours = [line for line in out.splitlines() if line.startswith("sparseloco.fault_tolerance: ")
                and not HEAL.match(line) and " healed from " not in line]  # the two replicas' first meeting
        assert ours and ours[0].startswith(f"sparseloco.fault_tolerance: waiting for the torchft lighthouse at "
                                           f"{job.url} (Connection refused)"), out[-3000:]
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"error: sparseloco.fault_tolerance: the torchft lighthouse at {job.url} does not "
                               "answer (Connection refused; waited "), out[-3000:]
        assert "restart it (torchft_lighthouse --bind 127.0.0.1:" in last and "free space" not in out, last
