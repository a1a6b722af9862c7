"""Fault-tolerant SparseLoCo on torchft (nanotron_ext.sparseloco.fault), CPU/gloo, one process per replica and a
torchft lighthouse in this process. Replicas are SIGKILLed in the middle of an inner loop and in the middle of an
outer sync, then started again: the survivors train every step without a gap, the sync a peer died in is retried
with the next quorum, the restarted replica is healed from a live peer (the global weights and outer state, zero
error feedback), and at every outer sync that several replicas committed they hold bit-identical global weights
(compared by hash across processes, so the check does not trust the code's own bookkeeping)."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch

from tests.helpers.dist import free_port

torchft = pytest.importorskip("torchft")  # the `ft` extra (in the dev extra that make setup installs)

H = 3  # inner steps per outer sync


def _weights_hash(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _replica(index: int, lighthouse: str, steps: int, log: str, kill_at_step: Optional[int],
             kill_in_sync: Optional[int], step_sleep: float, stop_file: Optional[str]) -> None:
    """One replica job (dp = 1): a 48 x 32 linear trained by SGD on its own seeded data; SIGKILLs itself at
    `kill_at_step` (after that step's optimiser step, mid-inner-loop) or inside its `kill_in_sync`-th outer sync
    (after the quorum, during the payload gather); ends after an outer sync once `stop_file` exists, at the latest
    after `steps` steps. Appends one JSON line per step and per committed sync."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.config import FaultToleranceConfig, SparseLoCoConfig
    from nanotron_ext.sparseloco.fault import FaultTolerantSparseLoCoSync

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 32)
    ft = FaultToleranceConfig(enabled=True, lighthouse=lighthouse, replica=index, replicas=3, min_replicas=2,
                              timeout_s=15, quorum_timeout_s=60, max_retries=5)
    cfg = SimpleNamespace(sparseloco=SparseLoCoConfig(inner_steps=H, chunk=64, topk=8, index_bits=6,
                                                      fault_tolerance=ft))
    sync = FaultTolerantSparseLoCoSync(model, ctx, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = open(log, "a")

    def write(record: Dict[str, object]) -> None:
        out.write(json.dumps({"replica": index, "pid": os.getpid(), **record}) + "\n")
        out.flush()

    gather, syncs_seen = sync._gather, [0]

    def gather_then_die(send: bool, error: List[torch.Tensor]):  # dies after the quorum, inside the sync
        syncs_seen[0] += 1
        if syncs_seen[0] == kill_in_sync:
            write({"event": "killed_in_sync", "ft_step": sync.manager.current_step()})
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(send, error)

    sync._gather = gather_then_die
    committed = [0]

    def record_sync(kind: str) -> None:
        if sync.manager.current_step() != committed[0]:
            committed[0] = sync.manager.current_step()
            write({"event": kind, "ft_step": committed[0], "healed": sync.healed, "syncs": sync.outer.syncs,
                   "global": _weights_hash(sync.outer.global_params), "local": _weights_hash(sync.params),
                   "error_zero": all(not e.any() for e in sync.error), "attempts": sync.attempts[-1]})

    sync.start()
    record_sync("join")
    gen = torch.Generator().manual_seed(1000 + index)
    for step in range(1, steps + 1):
        x = torch.randn(16, 48, generator=gen)
        loss = ((model(x) - x[:, :32]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        write({"event": "step", "step": step, "loss": loss.item()})
        if step == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        sync.after_step(step)
        record_sync("sync")
        if step % H == 0 and stop_file and os.path.exists(stop_file):
            break
        time.sleep(step_sleep)
    write({"event": "done", "ledger": get_ledger().snapshot().get("ft", {})})
    sync.close()
    out.close()
    os._exit(0)  # torchft's server threads: do not wait for interpreter teardown


def _records(log: Path) -> List[Dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _run_churn(tmp_path: Path, kill: Dict[str, int]) -> List[Dict[str, object]]:
    """Three replicas; replica 2 dies as `kill` says and is started again once it is dead (a fresh process, no
    checkpoint) for 4 outer syncs; the survivors train until it has finished. Returns the log."""
    from torchft.coordination import LighthouseServer

    # join_timeout longer than an inner loop: a quorum waits for every live (heartbeating) replica to reach its
    # sync, so a replica that (re)starts mid-loop cannot form a quorum of its own (a second lineage of weights);
    # a dead replica stops heartbeating and is dropped after heartbeat_timeout. min_replicas 2: the replica whose
    # process starts first cannot commit syncs alone before the others heartbeat (CI once saw replica 2 do so,
    # then die inside the sync while the other two were healing from it)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=20000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=1500)
    log, stop = tmp_path / "log.jsonl", tmp_path / "stop"
    spawn = mp.get_context("spawn")
    procs = []
    try:
        def start(i: int, n: int, stop_file: Optional[Path] = None, **kw: object) -> mp.Process:
            p = spawn.Process(target=_replica, args=(i, lighthouse.address(), n, str(log), kw.get("kill_at_step"),
                                                     kw.get("kill_in_sync"), 0.1, stop_file and str(stop_file)))
            p.start()
            procs.append(p)
            return p

        start(0, 5000, stop), start(1, 5000, stop)  # until the restarted replica is done
        victim = start(2, 5000, **kill)
        victim.join(timeout=90)
        assert victim.exitcode == -signal.SIGKILL, f"replica 2 was to be killed, exit code {victim.exitcode}"
        restarted = start(2, 4 * H)
        restarted.join(timeout=120)
        assert restarted.exitcode == 0, f"the restarted replica: exit code {restarted.exitcode}"
        stop.touch()
        for p in procs[:2]:
            p.join(timeout=60)
        assert not any(p.is_alive() for p in procs), "a replica did not finish in time (deadlock?)"
        assert all(p.exitcode == 0 for p in procs[:2]), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return _records(log)


def _check_churn(records: List[Dict[str, object]]) -> None:
    # the survivors trained every step, in order, with finite losses, past the restarted replica's syncs, and finished
    for i in (0, 1):
        mine = [r for r in records if r["replica"] == i]
        steps = [r["step"] for r in mine if r["event"] == "step"]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) > 4 * H, (i, steps)
        assert all(abs(r["loss"]) < 1e3 for r in mine if r["event"] == "step")
        assert mine[-1]["event"] == "done"
    # every torchft step committed by several replicas: the same global weights, and the same local weights
    # (everyone took the global ones)
    syncs = [r for r in records if r["event"] in ("join", "sync")]
    by_step: Dict[int, List[Dict[str, object]]] = {}
    for r in syncs:
        by_step.setdefault(r["ft_step"], []).append(r)
    for step, rs in by_step.items():
        assert len({r["global"] for r in rs}) == 1, (step, rs)
        assert len({r["local"] for r in rs}) == 1, (step, rs)
    # the restarted replica (the last pid of replica 2) was healed from a live peer with zero error feedback, and
    # its syncs after the heal are also committed by a survivor
    second = [r for r in syncs if r["replica"] == 2 and r["pid"] == max(x["pid"] for x in records if x["replica"] == 2)]
    assert second and second[0]["healed"] and second[0]["error_zero"], second[:1]
    shared = [r for r in second if any(o["replica"] != 2 for o in by_step[r["ft_step"]])]
    assert len(shared) >= 2, "the restarted replica never synced with the survivors"
    done = [r for r in records if r["event"] == "done"]
    # recovery traffic in the ledger: the healed replica received the float32 global weights (a closed form: the
    # 48 x 32 linear's 1568 parameters, no outer momentum), a survivor staged them
    assert [d["ledger"]["recv:recovery"]["bytes"] for d in done if d["replica"] == 2] == [1568 * 4]
    staged = [d["ledger"].get("send:recovery", {"bytes": 0, "calls": 0}) for d in done if d["replica"] < 2]
    assert sum(c["calls"] for c in staged) >= 1 and all(c["bytes"] == c["calls"] * 1568 * 4 for c in staged), staged
    # each payload: 1 flag byte + 200 kept entries as bf16 values and 6-bit indices (closed form), per gather
    payload = 1 + 200 * 2 + (200 * 6 + 7) // 8
    for d in done:
        gathers = d["ledger"]["all_gather"]
        assert gathers["bytes"] == gathers["calls"] * payload, (d["replica"], gathers, payload)
    assert all(d["ledger"].get("quorum", {}).get("calls", 0) > 0 for d in done)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replica_killed_mid_inner_loop_rejoins_fault(tmp_path: Path) -> None:
    """Replica 2 dies at step 5 (between syncs at 3 and 6); the survivors' sync at 6 drops it."""
    _check_churn(_run_churn(tmp_path, {"kill_at_step": 5}))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replica_killed_mid_sync_retried_then_rejoins_fault(tmp_path: Path) -> None:
    """Replica 2 dies inside its second outer sync, after the quorum that includes it: the survivors' gather
    fails, torchft votes no, and the sync is retried with the next quorum (attempts > 1), never applied half."""
    records = _run_churn(tmp_path, {"kill_in_sync": 3})
    _check_churn(records)
    retried = [r for r in records if r["event"] == "sync" and r["replica"] in (0, 1) and r["attempts"] > 1]
    assert retried, "no survivor sync needed a retry: the kill did not land mid-sync"


HETERO = ["model.codec.boundaries=every_layer", "model.tie_embeddings=false", "sparseloco.fault_tolerance.replicas=2",
          "sparseloco.compressed_replicas=[1]"]


@pytest.mark.parametrize("override,key", [
    (["parallelism.dp=2"], "parallelism.dp"),
    (["sparseloco.fault_tolerance.replica=2"], "sparseloco.fault_tolerance.replica"),
    (["sparseloco.fault_tolerance.lighthouse=localhost:29510"], "sparseloco.fault_tolerance.lighthouse"),
    (["sparseloco.fault_tolerance.max_retries=-1"], "sparseloco.fault_tolerance.max_retries"),
    # heterogeneous replicas are allowed (tests/test_sparseloco_hetero_ft.py), within fault_tolerance.replicas, but
    # not with Grassmann updates of the shared U (their statistics would need averaging across the replica jobs)
    (HETERO[:-1] + ["sparseloco.compressed_replicas=[2]"], "sparseloco.compressed_replicas"),
    (HETERO + ["sparseloco.grassmann_every=10"], "sparseloco.grassmann_every"),
])
def test_fault_tolerance_config_errors_name_the_key(override: List[str], key: str) -> None:
    """The example loads, with compressed replicas too; a bad fault-tolerance setting fails at load, naming the
    key."""
    from nanotron_ext.config import ConfigError, load_config

    example = Path(__file__).parent.parent / "examples" / "config_tiny_sparseloco_ft.yaml"
    assert load_config(str(example)).sparseloco.fault_tolerance.enabled
    for replica in (0, 1):  # each job is its replica's model: replica 1 the compressed one
        cfg = load_config(str(example), overrides=HETERO + [f"sparseloco.fault_tolerance.replica={replica}"])
        cfg.validate(world_size=1)
        from nanotron_ext.models.build import replica_config

        assert replica_config(cfg, 0).model.codec.kind == ("subspace" if replica else "identity")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg = load_config(str(example), overrides=override)
        cfg.validate(world_size=cfg.parallelism.dp)


def _ft_launch(small_corpus: Path, out: Path, port: int, pp: int = 1) -> subprocess.Popen:
    """ft_launch with two trainer jobs of 12 steps (H = 2, checkpoints every 4), every sync waiting for both; each
    replica a pipeline of `pp` stages (pp processes)."""
    from tests.test_trainer import _small_overrides

    sets = _small_overrides(small_corpus, out, 1, 1, pp, 12) + [
        "general.run=ft", "sparseloco.inner_steps=2", "sparseloco.topk=8", "checkpoints.interval=4",
        "checkpoints.keep_last=3",
        "sparseloco.fault_tolerance.min_replicas=2", f"sparseloco.fault_tolerance.lighthouse=http://127.0.0.1:{port}"]
    example = Path(__file__).parent.parent / "examples" / "config_tiny_sparseloco_ft.yaml"
    cmd = [sys.executable, "-m", "nanotron_ext.sparseloco.ft_launch", f"--nproc_per_node={pp}", "--max-restarts=0",
           "--config-file", str(example), *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_replicas_agree_and_resume_bit_exactly_without_fault(small_corpus: Path, tmp_path: Path) -> None:
    """The launcher path (ft_launch: a lighthouse and two trainer jobs, dp = 1 each, their own data shards): after
    the last outer sync both replicas' saved weights are bit-identical and the byte report has group ft; launched
    again with its step-8 and step-12 checkpoints deleted, it resumes from step 4 and ends with the same weights.
    (A launch stopped after step 4 and relaunched resumed from the same step-4 checkpoints, and a 12-step run could
    finish before the signal landed, so the straight run's own checkpoints serve: one ft_launch fewer.)"""
    from tests.test_trainer import _shard_models

    a = tmp_path / "a"
    straight = _ft_launch(small_corpus, a, free_port())
    out, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, out[-3000:]
    final = [_shard_models(a / f"ckpt_r{r}" / "step_12")["pp0_dp0_tp0.pt"] for r in (0, 1)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    first = [_records(a / f"ft_r{r}" / "metrics.jsonl")[0] for r in (0, 1)]
    assert first[0]["loss"] != first[1]["loss"]  # each replica reads its own shard
    assert all(json.loads((a / f"ft_r{r}" / "summary.json").read_text())["comm_bytes_per_step"]["ft"] > 0
               for r in (0, 1))

    for later in [*a.glob("ckpt_r*/step_8*"), *a.glob("ckpt_r*/step_12*")]:
        shutil.rmtree(later)
    relaunch = _ft_launch(small_corpus, a, free_port())
    out, _ = relaunch.communicate(timeout=300)
    assert relaunch.returncode == 0, out[-3000:]
    for r in (0, 1):
        assert f"resumed from {a / f'ckpt_r{r}'}/step_4 at step 4" in out, out[-3000:]
        resumed = _shard_models(a / f"ckpt_r{r}" / "step_12")["pp0_dp0_tp0.pt"]
        assert sorted(resumed) == sorted(final[r]) and all(torch.equal(final[r][k], resumed[k]) for k in resumed), r


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replicas_that_are_pipelines_agree_stage_by_stage_without_fault(small_corpus: Path, tmp_path: Path) -> None:
    """Replicas that are themselves parallel (torchft issue #171): two replicas of two pipeline stages each (four
    processes; rank (pp, tp) of one replica gathers with rank (pp, tp) of the other) end with bit-identical
    weights on every stage after the last outer sync, from different data shards."""
    from tests.helpers.dist import free_port
    from tests.test_trainer import _shard_models

    launch = _ft_launch(small_corpus, tmp_path, free_port(), pp=2)
    out, _ = launch.communicate(timeout=300)
    assert launch.returncode == 0, out[-3000:]
    final = [_shard_models(tmp_path / f"ckpt_r{r}" / "step_12") for r in (0, 1)]
    assert sorted(final[0]) == ["pp0_dp0_tp0.pt", "pp1_dp0_tp0.pt"] == sorted(final[1])
    for stage, shard in final[0].items():
        assert all(torch.equal(shard[k], final[1][stage][k]) for k in shard), stage
    first = [_records(tmp_path / f"ft_r{r}" / "metrics.jsonl")[0] for r in (0, 1)]
    assert first[0]["loss"] != first[1]["loss"]  # each replica reads its own shard
