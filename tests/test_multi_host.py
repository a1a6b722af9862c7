"""One job across two hosts that share no disk (issue 42): network namespaces stand for the hosts (each its own
shaped link and its own disk, bench/netns_hosts.py), one `nanotron_ext.launch --nnodes 2 --node-rank i` per host,
checkpoints.storage=per_host. A pipeline stage per host trains, a host dies mid-run and the job ends with one line
naming it, both hosts relaunch and resume from their own disks, and the losses are the single-host run's; export
reads every host's folder or refuses one host's alone by name. Needs root and namespaces (as CI has): skipped
otherwise."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import pytest

from nanotron_ext.bench.multi_host import EXAMPLE, REPO, disk_sets, last_line, start_job, wait_job
from nanotron_ext.bench.netns_hosts import Hosts, available
from nanotron_ext.metrics.logger import read_metrics
from nanotron_ext.train.checkpoint import list_checkpoints
from tests.conftest import SMALL_VOCAB
from tests.helpers.dist import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]

STEPS, EVERY = 12, 6


@pytest.fixture
def sets(small_corpus: Path) -> list:
    """The run's length, and the session's small prepared corpus (a fresh clone has no data/sotu)."""
    return [f"tokens.train_steps={STEPS}", f"checkpoints.interval={EVERY}", f"tokens.val_check_interval={STEPS}",
            *_data(small_corpus)]


def _data(corpus: Path) -> list:
    return [f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]


def _losses(run_dir: Path) -> dict:
    """{step: loss} of a run so far (none before its first step is logged)."""
    metrics = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(metrics) if "loss" in r} if metrics.is_file() else {}


def _single_host_worker(overrides: list) -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    Trainer(load_config(EXAMPLE, overrides)).train()


def _single_host(tmp: Path, sets: list) -> dict:
    """The same config on one host, two processes (forked ranks, torch preloaded), one shared folder: the
    reference losses."""
    run_distributed(_single_host_worker, 2, [*sets, f"general.output_dir={tmp}/runs", f"checkpoints.dir={tmp}/ckpt",
                                             "logging.progress_bar=false", "checkpoints.storage=shared"])
    return _losses(tmp / "runs" / "tiny_two_hosts")


def _export(run: Path, folders: list, out: Path) -> Tuple[int, str]:
    """python -m nanotron_ext.export in its own process (in this one, transformers would bind its logging handler
    to this test's captured stderr, closed when the test ends, and a later test's logging would fail on it): its
    exit code and what it wrote to stderr."""
    done = subprocess.run([sys.executable, "-m", "nanotron_ext.export", "--run", str(run), "--checkpoints",
                           *map(str, folders), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stderr


def test_two_hosts_pipeline_survives_a_dead_host_and_matches_one_host(tmp_path, sets):
    reference = _single_host(tmp_path / "one_host", sets)
    disk_at = tmp_path / "disk"
    sets = [*sets, *disk_sets(disk_at)]
    with Hosts(2, rate="200mbit", disk_root=tmp_path / "hosts", disk_at=disk_at) as hosts:
        ckpt = [hosts.disk(i) / "checkpoints" for i in range(2)]
        procs = start_job(hosts, EXAMPLE, sets, tmp_path / "logs1")
        deadline = time.monotonic() + 600
        while not all(list_checkpoints(c, []) for c in ckpt):  # step 6 complete on both hosts
            assert time.monotonic() < deadline and procs[0].poll() is None, last_line(tmp_path / "logs1/host0.log")
            time.sleep(0.5)
        killed = time.monotonic()
        hosts.kill_host(1)  # host 1 dies mid-run: its launcher and its worker
        codes = wait_job(procs, 300)
        line = last_line(tmp_path / "logs1" / "host0.log")
        assert codes[0] == 1 and time.monotonic() - killed < 120, (codes, line)
        assert line.startswith("error: rank 0 (node 0):") and "with rank 1 (node 1)" in line and "went away" in line, \
            line
        # each host's disk holds its own stage's shards only
        for i, c in enumerate(ckpt):
            (step, path), = list_checkpoints(c)[-1:]
            assert sorted(p.name for p in path.iterdir()) == ["meta.json", f"pp{i}_dp0_tp0.pt"], path
        # relaunch both: each resumes from its own disk and the job ends
        codes = wait_job(start_job(hosts, EXAMPLE, sets, tmp_path / "logs2"), 600)
        log0 = (tmp_path / "logs2" / "host0.log").read_text()
        assert codes == [0, 0], last_line(tmp_path / "logs2" / "host0.log")
        assert f"resumed from {disk_at}/checkpoints/step_{step} at step {step}" in log0
        losses = _losses(hosts.disk(0) / "runs" / "tiny_two_hosts")
        assert sorted(losses) == list(range(1, STEPS + 1))
        for s in losses:  # the same math over a real link and a resume as on one host
            assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-6), s
        # export: one host's folder is not the model; every host's is
        run = hosts.disk(0) / "runs" / "tiny_two_hosts"
        code, err = _export(run, ckpt[:1], tmp_path / "hf_refused")
        assert code == 2 and err.count("\n") == 1 and "node 1's shard pp1_dp0_tp0.pt" in err, err
        assert not (tmp_path / "hf_refused").exists()
        code, err = _export(run, ckpt, tmp_path / "hf")
        assert code == 0, err
        assert (tmp_path / "hf" / "config.json").is_file()
        # or one folder the hosts' files were copied into (each checked against the sha256 its host recorded)
        gathered = tmp_path / "gathered"
        shutil.copytree(ckpt[0], gathered)
        shutil.copy(ckpt[1] / f"step_{STEPS}" / "pp1_dp0_tp0.pt", gathered / f"step_{STEPS}")
        code, err = _export(run, [gathered], tmp_path / "hf_gathered")
        assert code == 0, err


def test_a_cut_link_ends_the_job_within_the_collective_timeout(tmp_path, sets):
    disk_at = tmp_path / "disk"
    sets = [*sets, *disk_sets(disk_at), "general.collective_timeout_s=10"]
    with Hosts(2, rate="200mbit", disk_root=tmp_path / "hosts", disk_at=disk_at) as hosts:
        procs = start_job(hosts, EXAMPLE, sets, tmp_path / "logs")
        log = tmp_path / "logs" / "host0.log"
        deadline = time.monotonic() + 600
        metrics = hosts.disk(0) / "runs" / "tiny_two_hosts" / "metrics.jsonl"
        while not (metrics.is_file() and "loss" in metrics.read_text()):  # training under way
            assert time.monotonic() < deadline and procs[0].poll() is None, last_line(log)
            time.sleep(0.5)
        cut = time.monotonic()
        hosts.set_link(1, False)  # host 1's cable cut: no error reaches anyone, only silence
        codes = wait_job(procs, 300)
        line = last_line(log)
        assert codes[0] != 0 and time.monotonic() - cut < 10 + 60, (codes, line)
        assert line.startswith("error: rank 0 (node 0):") and "timed out" in line, line
        assert "collective_timeout_s=10" in line, line


FT_EXAMPLE = REPO / "examples" / "config_tiny_sparseloco_ft.yaml"


def _ft_launch(hosts: Hosts, i: int, disk_at: Path, log: Path, corpus: Path) -> subprocess.Popen:
    """Host i's replica of a 2-replica fault-tolerant SparseLoCo job; host 0 also serves the lighthouse."""
    argv = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", "--config-file", str(FT_EXAMPLE),
            "--replicas", str(i), "--max-restarts", "0", *(["--no-lighthouse"] if i else [])]
    for s in [f"sparseloco.fault_tolerance.lighthouse=http://{hosts.addr(0)}:29510", f"checkpoints.dir={disk_at}/ckpt",
              f"general.output_dir={disk_at}/runs", "tokens.train_steps=120", "checkpoints.interval=10",
              "tokens.val_check_interval=120", "logging.progress_bar=false", *_data(corpus)]:
        argv += ["--set", s]
    return hosts.popen(i, argv, env={"OMP_NUM_THREADS": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                       cwd=REPO)


def test_sparseloco_replicas_on_two_hosts_lose_one_and_take_it_back(tmp_path, small_corpus):
    disk_at = tmp_path / "disk"
    with Hosts(2, rate="200mbit", disk_root=tmp_path / "hosts", disk_at=disk_at) as hosts:
        procs = [_ft_launch(hosts, i, disk_at, tmp_path / f"host{i}.log", small_corpus) for i in range(2)]
        runs = [hosts.disk(i) / "runs" / f"tiny_sparseloco_ft_r{i}" for i in range(2)]
        deadline = time.monotonic() + 600
        while not list_checkpoints(hosts.disk(1) / "ckpt_r1", []):
            assert time.monotonic() < deadline and procs[1].poll() is None, last_line(tmp_path / "host1.log")
            time.sleep(0.5)
        hosts.kill_host(1)  # replica 1's host disappears
        gone_at = max(_losses(runs[0]), default=0)  # (replica 0 may not have logged a step yet under load)
        # replica 0 trains on alone: 4 outer syncs of H = 5 (a quorum of 1)
        while max(_losses(runs[0]), default=0) < gone_at + 20:
            assert time.monotonic() < deadline and procs[0].poll() is None, last_line(tmp_path / "host0.log")
            time.sleep(0.5)
        procs[1] = _ft_launch(hosts, 1, disk_at, tmp_path / "host1_again.log", small_corpus)  # the host comes back
        codes = [p.wait(600) for p in procs]
        again = (tmp_path / "host1_again.log").read_text()
        assert codes == [0, 0], (last_line(tmp_path / "host0.log"), last_line(tmp_path / "host1_again.log"))
        assert f"resumed from {disk_at}/ckpt_r1/step_" in again
        # rejoined: at its first sync it took the global weights from replica 0 over the network (it then trains on
        # alone past replica 0's end, from its own older step count, with the lighthouse host 0 keeps serving)
        assert "replica 1 took the global weights and outer state of outer sync" in again, again[-2000:]
        assert json.loads((runs[1] / "summary.json").read_text())["steps"] == 120
