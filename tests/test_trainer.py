"""The training job as users run it: exact resume across a restart with TP x PP (and DP) > 1,
bad layouts rejected before any process group exists, and a dead rank ending the job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_VOCAB
from tests.helpers.dist import run_distributed

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "config_tiny_llama.yaml"


def _small_overrides(corpus: Path, out: Path, dp: int, tp: int, pp: int, steps: int) -> list:
    return [
        f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
        f"tokenizer.vocab_size={SMALL_VOCAB}",
        f"model.vocab_size={SMALL_VOCAB}", "model.hidden_size=32", "model.ffn_size=64", "model.num_layers=4",
        "model.tie_embeddings=false", f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
        "tokens.sequence_length=16", "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=2",
        f"tokens.train_steps={steps}", "tokens.val_check_interval=2", "tokens.val_steps=2", "optimizer.warmup_steps=2",
        f"general.output_dir={out}", f"checkpoints.dir={out / 'ckpt'}", "logging.progress_bar=false",
    ]


def _train_worker(overrides: list, stop_after, interval: int) -> dict:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    cfg = load_config(TINY, overrides + [f"checkpoints.interval={interval}"])
    trainer = Trainer(cfg)
    trainer.train(stop_after=stop_after)
    return {name: p.detach().clone() for name, p in trainer.replica.model.named_parameters()}


def _straight_worker(overrides: list) -> None:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    Trainer(load_config(TINY, overrides)).train()


def _losses(run_dir: Path) -> dict:
    from nanotron_ext.metrics.logger import read_metrics

    return {r["step"]: (r["loss"], r.get("val_loss")) for r in read_metrics(run_dir / "metrics.jsonl")}


def _shard_models(ckpt: Path) -> dict:
    """{shard file name: model state} of a checkpoint folder, read back as any user would."""
    return {f.name: torch.load(f, map_location="cpu", weights_only=True)["model"] for f in sorted(ckpt.glob("*.pt"))}


def kill_and_resume(corpus: Path, tmp_path: Path, dp: int, tp: int, pp: int, kill: str, steps: int,
                    extra: list = ()) -> int:
    """Train `steps` straight (forked ranks), and again as a launched job SIGKILLed (one worker, or the launcher)
    right after its first complete checkpoint and relaunched: the relaunch resumes, and every logged loss and the
    final weights of every rank equal the straight run's bit for bit. Returns the step the relaunch resumed from."""
    from nanotron_ext.train.checkpoint import latest_checkpoint
    from tests.helpers.jobs import alive, kill_job, run_job, start_job, wait_for, workers

    world = dp * tp * pp
    a, b = tmp_path / "a", tmp_path / "b"
    # the straight run on forked ranks (torch already imported: a third of the test's CPU was this job's start)
    run_distributed(_straight_worker, world, _small_overrides(corpus, a, dp, tp, pp, steps) + list(extra))
    overrides = _small_overrides(corpus, b, dp, tp, pp, steps) + list(extra)
    proc = start_job(world, overrides)
    pids: list = []
    try:
        wait_for(lambda: latest_checkpoint(b / "ckpt") is not None, proc, "a complete checkpoint", poll=0.02)
        pids = workers(proc)
        os.kill(pids[-1] if kill == "worker" else proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        deadline = time.time() + 30
        while any(alive(p) for p in pids) and time.time() < deadline:  # they hold the run's locks
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "workers outlived the kill"
    finally:
        kill_job(proc, pids)
    assert proc.returncode != 0
    killed_at = latest_checkpoint(b / "ckpt")
    assert killed_at is not None and killed_at.name != f"step_{steps}", (
        f"the job finished before the kill ({killed_at})")
    again = run_job(world, overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [ln for ln in again.stdout.splitlines() if ln.startswith("resumed from ")]
    assert len(resumed) == 1 and resumed[0].startswith(f"resumed from {b / 'ckpt'}/step_"), again.stdout[-3000:]
    la, lb = _losses(a / "tiny_llama"), _losses(b / "tiny_llama")
    assert sorted(la) == sorted(lb) == list(range(1, steps + 1))
    for step in la:
        assert la[step] == lb[step], (step, la[step], lb[step])
    wa, wb = _shard_models(a / "ckpt" / f"step_{steps}"), _shard_models(b / "ckpt" / f"step_{steps}")
    assert sorted(wa) == sorted(wb) and len(wa) == world
    for shard in wa:
        for name in wa[shard]:
            assert torch.equal(wa[shard][name], wb[shard][name]), (shard, name)
    return int(resumed[0].rsplit(" at step ", 1)[1])


@pytest.mark.slow
@pytest.mark.timeout(600)  # three jobs of 4 processes: ~50 s alone, ~100 s beside another worker's test
def test_a_killed_job_resumes_bit_exactly(small_corpus: Path, tmp_path: Path) -> None:
    """A real interruption (SIGKILL of a worker, at whatever point the job has reached), not a clean in-process
    stop. The launcher's SIGKILL at dp = 2 x pp = 2 is test_sparseloco_resume's pp = 2 case (the same layout and
    helper, with SparseLoCo's outer state in the checkpoint too)."""
    resumed_at = kill_and_resume(small_corpus, tmp_path, 1, 2, 2, "worker", 12, ["checkpoints.interval=2"])
    assert 2 <= resumed_at < 12


def _run_train_cli(overrides: list, world_size: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # port 1: any process-group init would fail loudly
    args = [sys.executable, "-m", "nanotron_ext.train", "--config-file", str(TINY)] + [a for o in overrides
                                                                                       for a in ("--set", o)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        (["parallelism.dp=2"], 3, "world size 3 != parallelism.dp * tp * pp = 2 * 1 * 1 = 2"),
        (["parallelism.dp=1", "parallelism.tp=3"], 3, "model.hidden_size=128 is not divisible by parallelism.tp=3"),
        (["parallelism.dp=1", "parallelism.pp=8", "model.tie_embeddings=false"], 8,
         "model.num_layers=4 is fewer than pipeline stages parallelism.pp=8"),
        (["parallelism.dp=1", "parallelism.tp=8", "model.num_heads=4"], 8, "is not divisible by parallelism.tp=8"),
    ],
)
def test_bad_layout_fails_before_process_groups(overrides: list, world: int, expected: str) -> None:
    proc = _run_train_cli(overrides, world)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "init_process_group" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        (["parallelism.dp=2"], 3, "error: world size 3 != parallelism.dp * tp * pp = 2 * 1 * 1 = 2"),
        (["parallelism.dp=1", "parallelism.pp=4", "model.num_layers=2", "model.tie_embeddings=false"], 4,
         "error: model.num_layers=2 is fewer than pipeline stages parallelism.pp=4"),
        (["parallelism.dp=1", "parallelism.tp=4"], 4,
         "error: model.num_kv_heads=2 is not divisible by parallelism.tp=4"),
    ],
)
def test_bad_layout_is_one_line_and_exit_2_through_the_launcher(tmp_path: Path, overrides: list, world: int,
                                                                 expected: str) -> None:
    from tests.helpers.jobs import run_job

    proc = run_job(world, overrides + [f"general.output_dir={tmp_path}", f"checkpoints.dir={tmp_path / 'ckpt'}"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(expected) and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_dead_rank_ends_the_job_quickly_naming_it(small_corpus: Path, tmp_path: Path) -> None:
    from tests.helpers.jobs import kill_job, metrics_lines, start_job, wait_for, workers

    proc = start_job(2, _small_overrides(small_corpus, tmp_path, 2, 1, 1, 100000))
    pids: list = []
    try:
        wait_for(lambda: metrics_lines(tmp_path / "tiny_llama") >= 2, proc, "two training steps")
        pids = workers(proc)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        out, _ = proc.communicate(timeout=90)
        assert time.time() - killed_at < 60
    finally:
        kill_job(proc, pids)
    # the launcher's last line names the dead rank (and rank 0's own report of losing it, when it had one)
    assert proc.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in last, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


# ---------------------------------------------------------------- hardening (issue 12)


def _nan_worker(overrides: list) -> dict:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.errors import TrainingError
    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides + ["checkpoints.interval=1", "checkpoints.keep_last=2"]))
    trainer.train(stop_after=2)
    with torch.no_grad():
        next(trainer.replica.model.parameters()).fill_(float("nan"))  # what rope_theta=0 or lr=inf used to produce
    try:
        trainer.train()
    except TrainingError as e:
        return {"error": str(e), "step": trainer.step}
    return {"error": None, "step": trainer.step}


@pytest.mark.slow
def test_non_finite_loss_stops_naming_the_step_and_keeps_good_checkpoints(small_corpus: Path, tmp_path: Path) -> None:
    # case 3: a NaN loss used to train on, save NaN checkpoints and prune the last good ones
    [out] = run_distributed(_nan_worker, 1, _small_overrides(small_corpus, tmp_path, 1, 1, 1, 6))
    assert out["error"] is not None and out["step"] == 2
    assert out["error"].startswith("step 3: the loss is nan") and "nothing was saved" in out["error"]
    # the weights that gave the NaN are step 2's: its checkpoint is set aside, step 1 is the last good one
    ckpt = tmp_path / "ckpt"
    assert f"checkpoint {ckpt / 'step_2'} holds the weights that gave this loss and was moved to {ckpt / 'step_2'}" \
        ".diverged" in out["error"] and f"last complete checkpoint is {ckpt / 'step_1'}" in out["error"], out["error"]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_1", "step_2.diverged"]


def _rerun_worker(overrides: list) -> dict:
    import contextlib
    import io

    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.sources import DataError
    from nanotron_ext.train.trainer import Trainer

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            summary = Trainer(load_config(TINY, overrides)).train()
        except DataError as e:
            summary = {"error": str(e)}
    return {"stdout": out.getvalue(), "summary": summary}


@pytest.mark.slow
def test_rerunning_a_finished_run_reports_it_and_rewrites_nothing(small_corpus: Path, tmp_path: Path) -> None:
    # case 2: a second launch used to overwrite summary.json with null losses and config.yaml even when it failed
    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 3)
    [first] = run_distributed(_rerun_worker, 1, overrides)
    run_dir = tmp_path / "tiny_llama"
    # .lock (the run lock of case 4) names its latest holder; everything else must stay as it is
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir() if p.is_file()
             and p.name != ".lock"}
    assert {"summary.json", "config.yaml", "metrics.jsonl"} <= set(files)
    [again] = run_distributed(_rerun_worker, 1, overrides)
    assert f"run {run_dir} is complete (step 3 of 3" in again["stdout"], again["stdout"]
    assert f"final train loss      {first['summary']['final_train_loss']:.4f}" in again["stdout"]
    assert again["summary"] == first["summary"]
    [failed] = run_distributed(_rerun_worker, 1,
                               overrides + ["general.seed=7", f"data.prepared_dir={tmp_path / 'none'}"])
    assert "run `python -m nanotron_ext.data prepare" in failed["summary"]["error"]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()
            if p.is_file() and p.name != ".lock"} == files


@pytest.mark.slow
def test_a_second_launch_on_busy_folders_fails_at_once_and_never_overwrites_checkpoints(small_corpus: Path,
                                                                                        tmp_path: Path) -> None:
    # case 4: two launches with one run name used to collide; resume=never silently overwrote another run's checkpoints
    from tests.helpers.jobs import kill_job, metrics_lines, run_job, start_job, wait_for, workers

    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 100000) + ["checkpoints.interval=1"]
    first = start_job(1, overrides)
    try:
        wait_for(lambda: metrics_lines(tmp_path / "tiny_llama") >= 2, first, "two training steps")
        [holder] = workers(first)
        second = run_job(1, overrides, timeout=120)
        assert second.returncode == 2 and f"is in use by a running job (pid {holder} on" in second.stderr, second.stderr
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr, second.stderr
        # another run name, the same checkpoints.dir: the checkpoint folder's own lock refuses it
        other = run_job(1, overrides + ["general.run=other"], timeout=120)
        assert other.returncode == 2 and other.stderr.startswith(f"error: checkpoint folder {tmp_path / 'ckpt'} is in "
                                                                 f"use by a running job (pid {holder} on"), other.stderr
    finally:
        kill_job(first)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    third = run_job(1, overrides + ["checkpoints.resume=never"], timeout=120)
    assert third.returncode == 2, third.stderr
    assert f"checkpoints.dir {tmp_path / 'ckpt'} holds checkpoints" in third.stderr, third.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == saved


def _resume_worker(overrides: list) -> str:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.checkpoint import CheckpointError
    from nanotron_ext.train.trainer import Trainer

    try:
        Trainer(load_config(TINY, overrides)).train()
    except CheckpointError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_unloadable_checkpoint_names_the_previous_one_and_the_changed_keys(small_corpus: Path, tmp_path: Path) -> None:
    # case 9: a corrupt shard stopped the run without pointing anywhere; a changed shape gave `size mismatch`
    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 2) + ["checkpoints.interval=1"]
    assert run_distributed(_resume_worker, 1, overrides) == [""]
    ckpt = tmp_path / "ckpt"
    shard = ckpt / "step_2" / "pp0_dp0_tp0.pt"
    data = bytearray(shard.read_bytes())
    data[-100:] = bytes(100)
    shard.write_bytes(bytes(data))
    [msg] = run_distributed(_resume_worker, 1, overrides + ["tokens.train_steps=4"])
    assert "does not match the sha256" in msg, msg
    assert (f"the previous complete checkpoint is {ckpt / 'step_1'}: to resume from it, move "
            f"{ckpt / 'step_2'} out of the way (e.g. mv {ckpt / 'step_2'} {ckpt / 'step_2'}.bad)") in msg, msg
    (ckpt / "step_2").rename(ckpt / "step_2.bad")
    [msg] = run_distributed(_resume_worker, 1, overrides + ["tokens.train_steps=4", "model.hidden_size=64"])
    assert msg.startswith(f"checkpoint {ckpt / 'step_1'} was saved with other settings; config keys that differ from "
                          "the checkpoint's (saved -> now): model.hidden_size 32 -> 64; set them back"), msg
    assert run_distributed(_resume_worker, 1, overrides + ["tokens.train_steps=4"]) == [""]  # resumes from step_1


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


@pytest.mark.slow
def test_workers_exit_when_torchrun_is_killed(small_corpus: Path, tmp_path: Path) -> None:
    # case 11: SIGKILL to torchrun left its workers training on, beside any restarted job
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 100000)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", "-m",
           "nanotron_ext.train",
           "--config-file", str(TINY)] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "tiny_llama" / "metrics.jsonl"
    workers: list = []
    try:
        deadline = time.time() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.time() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.5)
        workers = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)],
                                                  capture_output=True, text=True).stdout.split()]
        assert len(workers) == 2, workers
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.5)
        assert not any(_alive(w) for w in workers), "workers outlived their launcher"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_ctrl_c_prints_one_line_with_the_step_and_the_last_checkpoint(small_corpus: Path, tmp_path: Path,
                                                                     launcher: str) -> None:
    # case 8: Ctrl-C (SIGINT to the launcher's process group; it stops its workers with the same signal) prints
    # the step reached and the last complete checkpoint, once (under torchrun: before torchrun's own report)
    from nanotron_ext.train.checkpoint import latest_checkpoint
    from tests.helpers.jobs import kill_job, start_job, wait_for

    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 100000) + ["checkpoints.interval=2"]
    proc = start_job(2, overrides, launcher=launcher)
    try:  # a COMPLETE checkpoint: step_N.tmp-* is a save still in progress
        wait_for(lambda: latest_checkpoint(tmp_path / "ckpt") is not None, proc, "a checkpoint")
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_job(proc)
    lines = [ln for ln in out.splitlines() if ln.startswith("interrupted at step ")]
    assert len(lines) == 1, out[-3000:]
    step = int(lines[0].split()[3].rstrip(";"))
    assert step >= 2 and f"last complete checkpoint: {tmp_path / 'ckpt'}/step_" in lines[0], lines[0]
    if launcher == "launch":
        assert proc.returncode == 130 and out.strip().splitlines()[-1] == lines[0], out[-3000:]


# ---------------------------------------------------------------- round 2 (issue 21)


def _step_folders(ckpt: Path) -> dict:
    return {p.name: (p / "meta.json").read_bytes() for p in sorted(ckpt.iterdir()) if p.name.startswith("step_")}


@pytest.mark.slow
def test_resume_overwrite_deletes_nothing_until_the_new_run_has_a_checkpoint(small_corpus: Path,
                                                                             tmp_path: Path) -> None:
    # item 1: resume=overwrite deleted every checkpoint before the data was checked: a relaunch with a bad
    # data.prepared_dir left checkpoints.dir empty
    from tests.helpers.jobs import run_job

    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 3) + ["checkpoints.interval=1",
                                                                        "checkpoints.keep_last=3"]
    run_distributed(_straight_worker, 1, overrides)  # the run to relaunch over (forked: torch preloaded)
    ckpt = tmp_path / "ckpt"
    before = _step_folders(ckpt)
    assert sorted(before) == ["step_1", "step_2", "step_3"]
    bad = run_job(1, overrides + ["checkpoints.resume=overwrite", f"data.prepared_dir={tmp_path / 'none'}"])
    assert bad.returncode == 2 and "does not exist" in bad.stderr, bad.stderr[-3000:]
    assert _step_folders(ckpt) == before  # nothing lost
    # a good relaunch trains afresh; its first complete checkpoint replaces all the earlier ones
    again = run_job(1, overrides + ["checkpoints.resume=overwrite", "tokens.train_steps=2", "checkpoints.interval=2"])
    assert again.returncode == 0 and "resumed from" not in again.stdout, again.stderr[-3000:]
    after = _step_folders(ckpt)
    assert sorted(after) == ["step_2"] and after["step_2"] != before["step_2"]


@pytest.mark.slow
def test_a_lost_summary_is_rebuilt_from_the_metrics_and_the_final_checkpoint(small_corpus: Path,
                                                                             tmp_path: Path) -> None:
    # item 2: when the end of a run failed (disk full writing summary.json, a kill after the final checkpoint) the
    # relaunch said "complete ... but has no summary.json; nothing to do"
    import json

    from tests.helpers.jobs import run_job

    run_distributed(_straight_worker, 1, _small_overrides(small_corpus, tmp_path / "a", 1, 1, 1, 4))  # forked
    overrides = _small_overrides(small_corpus, tmp_path / "b", 1, 1, 1, 4)
    run_dir = tmp_path / "b" / "tiny_llama"
    (run_dir / "summary.json").mkdir(parents=True)  # the final write fails, as on a full disk
    failed = run_job(1, overrides)
    assert failed.returncode == 2 and f"{run_dir / 'summary.json'}" in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.count("\n") == 1
    (run_dir / "summary.json").rmdir()  # space freed
    (run_dir / "loss.png").unlink(missing_ok=True)
    again = run_job(1, overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run {run_dir} is complete (step 4 of 4" in again.stdout, again.stdout
    assert ("summary.json was missing and is rebuilt from metrics.jsonl (4 logged steps) and the checkpoint of step 4"
            in again.stdout), again.stdout
    a = json.loads((tmp_path / "a" / "tiny_llama" / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    assert b.pop("rebuilt") and a.pop("tokens_per_s") and b.pop("tokens_per_s")  # timings differ between runs
    assert a == b and a["final_val_loss"] is not None
    assert (run_dir / "loss.png").stat().st_size > 0
    third = run_job(1, overrides)  # and from then on it is a stored summary like any other
    assert third.returncode == 0 and "Its stored results:" in third.stdout


@pytest.mark.slow
def test_resume_refuses_changed_outer_loop_and_codec_settings_naming_the_keys(small_corpus: Path,
                                                                              tmp_path: Path) -> None:
    # item 9: SparseLoCo -> allreduce and outer_momentum 0 -> 0.9 gave per-rank tracebacks, a changed
    # compressed_replicas torch's multi-line state-dict dump, a codec int8 -> topk continued silently (and
    # rewrote the run's config.yaml)
    from tests.helpers.jobs import run_job

    sparseloco = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", "sparseloco.topk=8"]
    base = _small_overrides(small_corpus, tmp_path / "s", 2, 1, 1, 2) + ["checkpoints.interval=1"]
    run_distributed(_straight_worker, 2, base + sparseloco)  # the run to resume (forked: torch preloaded)
    ckpt = tmp_path / "s" / "ckpt" / "step_2"
    config_yaml = (tmp_path / "s" / "tiny_llama" / "config.yaml").read_bytes()
    for change, expected in [
        (["parallelism.dp_sync=allreduce"], "parallelism.dp_sync 'sparseloco' -> 'allreduce'"),
        (sparseloco + ["sparseloco.outer_momentum=0.9"], "sparseloco.outer_momentum 0.0 -> 0.9"),
        (sparseloco + ["sparseloco.compressed_replicas=[0]", "model.subspace.k=8",
                       "model.codec.boundaries=every_layer"], "sparseloco.compressed_replicas [] -> [0]"),
    ]:
        proc = run_job(2, base + change + ["tokens.train_steps=4"])
        # (the tiny model's 32-entry norm weights make SparseLoCo's density warning precede the error: not this test's)
        stderr = "".join(ln + "\n" for ln in proc.stderr.splitlines()
                         if not ln.startswith("sparseloco: overall density"))
        assert proc.returncode == 2 and stderr.count("\n") == 1, proc.stderr[-3000:]
        assert stderr.startswith(f"error: checkpoint {ckpt} was saved with other settings; config keys that differ "
                                      "from the checkpoint's (saved -> now): ") and expected in stderr, proc.stderr
    assert (tmp_path / "s" / "tiny_llama" / "config.yaml").read_bytes() == config_yaml
    # a codec change on one process (codec boundaries after every layer)
    codec = _small_overrides(small_corpus, tmp_path / "c", 1, 1, 1, 2) + ["model.codec.boundaries=every_layer"]
    run_distributed(_straight_worker, 1, codec + ["model.codec.kind=int8"])
    config_yaml = (tmp_path / "c" / "tiny_llama" / "config.yaml").read_bytes()
    proc = run_job(1, codec + ["model.codec.kind=topk", "tokens.train_steps=4"])
    assert proc.returncode == 2 and "model.codec.kind 'int8' -> 'topk'" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "c" / "tiny_llama" / "config.yaml").read_bytes() == config_yaml
    # the same settings resume as before
    again = run_job(1, codec + ["model.codec.kind=int8", "tokens.train_steps=4"])
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-3000:]


@pytest.mark.slow
def test_a_diverging_run_stops_before_saving_diverged_weights(small_corpus: Path, tmp_path: Path) -> None:
    # item 4: optimizer.lr=1e30 (now refused at load; 10 the largest accepted) trained to finite 1e30 weights (RMSNorm
    # keeps the loss finite), saved them, and the later error named that checkpoint as the last complete one; lr=1
    # climbed to a loss of 22 and trained on
    from tests.helpers.jobs import run_job

    def overrides(name: str, lr: float) -> list:
        return _small_overrides(small_corpus, tmp_path / name, 1, 1, 1, 12) + [f"optimizer.lr={lr}",
                                                                               "checkpoints.interval=1"]

    runaway = run_job(1, overrides("runaway", 10.0))  # (the largest lr the config accepts)
    assert runaway.returncode == 2 and runaway.stderr.count("\n") == 1, runaway.stderr[-3000:]
    assert runaway.stderr.startswith("error: step 1: the optimizer step grew the weights' norm from ") and \
        "more than general.max_weight_growth=10 in one step): training diverged; these weights were not saved. there " \
        f"is no complete checkpoint in {tmp_path / 'runaway' / 'ckpt'}" in runaway.stderr, runaway.stderr
    assert not list((tmp_path / "runaway" / "ckpt").glob("step_*"))
    ckpt = tmp_path / "climb" / "ckpt"
    climb = run_job(1, overrides("climb", 1.0))
    assert climb.returncode == 2 and climb.stderr.count("\n") == 1, climb.stderr[-3000:]
    first = _losses(tmp_path / "climb" / "tiny_llama")[1][0]
    assert (f"is more than 1.5x the run's first loss {first:.4g} (general.max_loss_ratio): training diverged"
            in climb.stderr)
    step = int(climb.stderr.split("error: step ")[1].split(":")[0])
    assert f"checkpoint {ckpt / f'step_{step - 1}'} holds the weights that gave this loss" in climb.stderr
    assert f"the last complete checkpoint is {ckpt / f'step_{step - 2}'}" in climb.stderr, climb.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))[-1] == f"step_{step - 1}.diverged"
    # the guard can be switched off: the same run then trains to the end
    free = run_job(1, overrides("free", 1.0) + ["general.max_loss_ratio=0"])
    assert free.returncode == 0, free.stderr[-3000:]


def _first_loss_worker(overrides: list) -> float:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer

    return Trainer(load_config(TINY, overrides)).guard.first_loss


@pytest.mark.slow
def test_the_divergence_reference_survives_a_resume(small_corpus: Path, tmp_path: Path) -> None:
    overrides = _small_overrides(small_corpus, tmp_path, 1, 1, 1, 2) + ["checkpoints.interval=1"]
    run_distributed(_train_worker, 1, overrides, None, 1)
    [first] = run_distributed(_first_loss_worker, 1, overrides + ["tokens.train_steps=4"])
    assert first == _losses(tmp_path / "tiny_llama")[1][0]
