"""The documented launcher (`python -m nanotron_ext.launch`, issue 21 items 5, 7 and 12): a user-facing error is
one line and exit code 2 for the command users type, not torchrun's banner and exit 1; plain torchrun still
works and shows the same line; a frozen worker ends the job within the collective timeout (+ 30 s) naming the
rank and the collective; a full run folder is one line naming the file, with no traceback from another rank."""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL_VOCAB
from tests.helpers.jobs import TINY, job_cmd, kill_job, metrics_lines, run_job, start_job, wait_for, workers
from tests.test_trainer import _small_overrides


def _data(corpus: Path) -> list:
    return [f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    return text.rstrip("\n")


@pytest.mark.parametrize("case", ["not prepared", pytest.param("unknown key", marks=pytest.mark.slow),
                                  pytest.param("world size", marks=pytest.mark.slow)])
def test_a_user_facing_error_is_one_line_and_exit_2_through_the_launcher(small_corpus: Path, tmp_path: Path,
                                                                         case: str) -> None:
    base = [f"general.output_dir={tmp_path}", f"checkpoints.dir={tmp_path / 'ckpt'}"] + _data(small_corpus)
    extra, expected = {
        "not prepared": ([f"data.prepared_dir={tmp_path / 'none'}"],
                         f"error: data.prepared_dir {tmp_path / 'none'} does not exist: run `python "
                         "-m nanotron_ext.data prepare"),
        # a two-line message (the allowed keys on the second) is still one line
        "unknown key": (["model.hiden_size=64"], "error: model.hiden_size: unknown key; did you mean 'hidden_size'?; "
                                                 "allowed keys in section model: vocab_size, hidden_size"),
        "world size": (["parallelism.dp=3"], "error: world size 2 != parallelism.dp * tp * pp = 3 * 1 * 1 = 3"),
    }[case]
    proc = run_job(2, base + extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr).startswith(expected), proc.stderr
    assert proc.stdout == "", proc.stdout


@pytest.mark.slow
def test_plain_torchrun_still_prints_the_line_and_its_report_carries_it(small_corpus: Path, tmp_path: Path) -> None:
    """torchrun keeps its own report and exit code 1, but rank 0's line comes first and the report shows it
    (the workers' error files) instead of "To enable traceback see ..."."""
    missing = tmp_path / "none"
    proc = run_job(2, [f"data.prepared_dir={missing}", f"general.output_dir={tmp_path}"], launcher="torchrun")
    line = f"error: data.prepared_dir {missing} does not exist"
    assert proc.returncode == 1 and proc.stderr.count(line) >= 2, proc.stderr[-3000:]  # rank 0, then the report
    assert proc.stderr.index(line) < proc.stderr.index("ChildFailedError")
    assert "To enable traceback" not in proc.stderr


# ------------------------------------------------------------------------------- the launcher's verdict


def _failure(tmp_path: Path, rank: int, exitcode: int, line: str = "", at: float = 0.0):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}_{exitcode}_{len(line)}.json"
    if line:
        path.write_text(json.dumps({"message": line, "timestamp": int(at),
                                    "nanotron_ext": {"exitcode": exitcode, "time": at, "rank": rank}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_the_verdict_prefers_the_user_facing_error_then_the_first_report(tmp_path: Path) -> None:
    from nanotron_ext.launch import verdict

    # the user-facing error wins even when another rank reported something earlier
    v = verdict({0: _failure(tmp_path, 0, 1, "error: rank 0: all_reduce ... went away", at=1.0),
                 1: _failure(tmp_path, 1, 2, "error: checkpoint step_4 ...", at=2.0)})
    assert v == ("error: checkpoint step_4 ...", 2)
    # a collective failure, then how the other ranks ended
    v = verdict({0: _failure(tmp_path, 0, 1, "error: rank 0: all_reduce on the dp group timed out", at=1.0),
                 1: _failure(tmp_path, 1, -9)})
    assert v == ("error: rank 0: all_reduce on the dp group timed out; then rank 1 (pid 101) was killed by SIGKILL", 1)
    # nothing reported (a kill, a crash with its own traceback above): the first to fail, then the others;
    # a rank the launcher stopped afterwards (exit 130, SIGTERM) is never the cause
    v = verdict({0: _failure(tmp_path, 0, 130), 1: _failure(tmp_path, 1, -9)})
    assert v == ("error: rank 1 (pid 101) was killed by SIGKILL (its output is above); then rank 0 (pid 100) was "
                 "stopped", 1)
    v = verdict({0: _failure(tmp_path, 0, -15), 1: _failure(tmp_path, 1, 3)})
    assert v == ("error: rank 1 (pid 101) exited with code 3 (its output is above); then rank 0 (pid 100) was "
                 "stopped", 3)
    assert verdict({0: _failure(tmp_path, 0, 130), 1: _failure(tmp_path, 1, 130)}) == ("", 130)  # interrupted


# ------------------------------------------------------------------------------- faults


@pytest.mark.slow
def test_a_frozen_worker_ends_the_job_within_the_timeout_naming_rank_and_collective(small_corpus: Path,
                                                                                   tmp_path: Path) -> None:
    # item 5: nanotron built the dp/tp/pp groups without a timeout: a SIGSTOPped worker hung the job past 240 s
    from nanotron_ext.launch import SHUTDOWN_TIMEOUT_S

    timeout_s = 10
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1,
                                 100000) + [f"general.collective_timeout_s={timeout_s}"]
    launched = time.time()
    proc = start_job(2, overrides)
    pids: list = []
    metrics = tmp_path / "tiny_llama" / "metrics.jsonl"
    try:
        wait_for(lambda: metrics_lines(tmp_path / "tiny_llama") >= 2, proc, "two training steps")
        startup = time.time() - launched  # imports, set-up, two steps: how slow this machine is right now
        pids = workers(proc)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.time()
        out, _ = proc.communicate(timeout=timeout_s + SHUTDOWN_TIMEOUT_S + max(30.0, startup) + 120)
        ended = time.time()
    finally:
        kill_job(proc, pids)
    # Measured from when the freeze took effect: rank 0's last complete step (its next collective waits on the
    # frozen rank). Then the collective timeout, the launcher's grace for the frozen rank (SIGTERM, then SIGKILL),
    # and work that slows with the machine's load (rank 0's step up to the collective, its report, both exits),
    # bounded by the measured start-up (30 s at least). Quiet: ~25 s against 50; CI once took 88.6 s at load ~20,
    # with a start-up in proportion. Groups without a timeout hung past 240 s; the default timeout is 120 s.
    froze = max(stopped, metrics.stat().st_mtime)
    bound = timeout_s + SHUTDOWN_TIMEOUT_S + max(30.0, startup)
    took = ended - froze
    assert proc.returncode == 1 and timeout_s <= ended - stopped and took < bound, \
        (proc.returncode, f"took {took:.1f} s from the freeze, bound {bound:.1f} s (start-up "
                          f"{startup:.1f} s)", out[-3000:])
    line = out.strip().splitlines()[-1]
    assert line.startswith("error: rank 0: ") and f" timed out (general.collective_timeout_s={timeout_s}): a peer " \
        "rank stopped responding" in line, out[-3000:]
    assert " on the world group " in line or " on the dp group " in line, line  # the control or gradient all-reduce
    assert line.split(": ")[2].split(" on the ")[0] in ("all_reduce", "broadcast", "all_gather"), line
    assert line.endswith(f"then rank 1 (pid {pids[1]}) was killed by SIGKILL"), line
    assert "Traceback" not in out
    print(f"froze -> end {took:.1f} s, stop -> end {ended - stopped:.1f} s, start-up {startup:.1f} s, "
          f"bound {bound:.1f} s")


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_a_full_run_folder_is_one_line_naming_the_file(small_corpus: Path, tmp_path: Path, launcher: str) -> None:
    # item 12: "[Errno 28] No space left on device" without the file, plus a rank-1 gloo traceback. A file size
    # limit stands in for the full disk: metrics.jsonl outgrows it after a few steps (no checkpoint before).
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 60) + ["checkpoints.interval=0"]
    proc = subprocess.run(job_cmd(2, overrides, launcher=launcher), capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(4000))
    metrics = tmp_path / "tiny_llama" / "metrics.jsonl"
    line = f"error: [Errno 27] File too large: '{metrics}'; free space there or make it writable"
    assert metrics.exists() and metrics.stat().st_size <= 4000
    assert "[rank" not in proc.stderr, proc.stderr[-3000:]  # no worker traceback (torch prefixes them [rankN]:)
    if launcher == "launch":
        assert proc.returncode == 2 and _one_line(proc.stderr).startswith(line), proc.stderr[-3000:]
    else:  # torchrun: rank 0's line, then torchrun's report (with torchrun's own traceback)
        assert proc.returncode == 1 and line in proc.stderr.split("ChildFailedError")[0], proc.stderr[-3000:]


# ------------------------------------------------------------------------------- interpreter exit (item 6)


def test_only_the_main_thread_reaches_interpreter_exit(small_corpus: Path, tmp_path: Path) -> None:
    """One clean run in ~60 ended with "terminate called without an active exception" (exit -6, no loss.png):
    threads were still running at interpreter exit: gloo's C++ threads of the process groups (kept alive past
    destroy_process_group by the trainer, nanotron's cached group lookups, and torch._dynamo when imported after
    the groups existed), tqdm's monitor, fsspec's event loop and the launcher watchdog. After a run, a worker
    must have its main thread alone."""
    from tests.helpers.jobs import REPO

    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 2) + ["logging.progress_bar=true"]
    cmd = job_cmd(2, overrides, launcher="torchrun")  # (either launcher: the workers' exit is the same)
    cmd[cmd.index("-m"):cmd.index("-m") + 2] = [str(REPO / "tests" / "helpers" / "threads_at_exit.py")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [ln for ln in proc.stdout.splitlines() if ln.startswith("threads at exit")]
    assert len(reports) == 2, proc.stdout[-3000:]
    for line in reports:
        # one native thread, the main one (named after the interpreter's file: python, python3 or python3.11,
        # whichever the launcher was installed with), and no Python thread
        assert re.search(r"native 1 \['python[\d.]*'\], python \[\]$", line), line


@pytest.mark.slow
def test_repeated_short_runs_all_end_cleanly(small_corpus: Path, tmp_path: Path) -> None:
    """The stress test of item 6: short runs back to back, each must exit 0 with its loss plot and summary (three:
    test_only_the_main_thread_reaches_interpreter_exit checks the cause on every run)."""
    for i in range(3):
        overrides = _small_overrides(small_corpus, tmp_path / str(i), 2, 1, 1, 2) + ["logging.progress_bar=true"]
        proc = run_job(2, overrides)
        run_dir = tmp_path / str(i) / "tiny_llama"
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (i, proc.stderr[-3000:])
        assert (run_dir / "loss.png").exists() and (run_dir / "summary.json").exists(), i


@pytest.mark.slow
@pytest.mark.parametrize("key", ["general.output_dir", "checkpoints.dir"])
def test_a_folder_that_cannot_be_written_is_one_line_naming_it(small_corpus: Path, tmp_path: Path, key: str) -> None:
    """A read-only folder (docs/failures.md's claim): as root, chmod does not stop writes, so a folder under /sys, where
    the kernel refuses mkdir to everyone, stands in for it."""
    if os.geteuid() == 0:
        folder = Path("/sys/nanotron_ext_test_not_writable")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        folder = tmp_path / "ro" / "sub"
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 2) + [f"{key}={folder}"]
    proc = run_job(2, overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr)
    assert line.startswith("error: ") and str(folder) in line and "make it writable" in line, line


# ------------------------------------------------------------------------------- the launcher's pre-flight


def test_the_launcher_refuses_a_bad_job_before_starting_any_worker(small_corpus: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys,
                                                                 request: pytest.FixtureRequest) -> None:
    """Config, layout against the world size, data and a resume with changed settings are refused by the
    launcher itself (one line, exit 2) without torchrun's `run` ever being called; a valid job, an elastic world
    size it cannot know, and a script that is not our trainer go through to it."""
    import logging

    import torch.distributed.run as torch_run
    from torch.distributed.launcher import api as launcher_api

    from nanotron_ext import launch
    from nanotron_ext.config.loader import config_to_dict, load_config
    from nanotron_ext.train.failures import LAUNCHER_ENV

    started: list = []
    monkeypatch.setattr(torch_run, "run", lambda args: started.append(args))
    # what launch.main sets for its workers stays out of this test process (a later job of this pytest worker would
    # inherit LAUNCHER_ENV and hand its error line to a launcher that is not there)
    monkeypatch.setenv(LAUNCHER_ENV, "0")  # (delenv of an absent variable records nothing to restore)
    monkeypatch.delenv(LAUNCHER_ENV)
    monkeypatch.setattr(launcher_api, "LocalElasticAgent", launcher_api.LocalElasticAgent)
    for logger in map(logging.getLogger, ("torch.distributed.run", "torch.distributed.elastic",
                                          "torch.distributed.launcher")):
        request.addfinalizer(lambda logger=logger, level=logger.level: logger.setLevel(level))
    base = _small_overrides(small_corpus, tmp_path / "run", 2, 1, 1, 4)

    def launch_with(overrides: list, *torchrun: str, module: str = "nanotron_ext.train") -> int:
        started.clear()
        return launch.main([*(torchrun or ["--nproc_per_node=2"]), "-m", module, "--config-file", str(TINY),
                            *[a for o in overrides for a in ("--set", o)]])

    ckpt = tmp_path / "run" / "ckpt" / "step_2"  # a complete checkpoint saved with SparseLoCo (no shard files)
    ckpt.mkdir(parents=True)
    saved = config_to_dict(load_config(TINY, base + ["parallelism.dp_sync=sparseloco"]))
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "files": [], "config": saved}))
    capsys.readouterr()
    for overrides, expected in [
        (["model.hiden_size=64"], "error: model.hiden_size: unknown key; did you mean 'hidden_size'?; allowed keys"),
        (["parallelism.dp=1"], "error: world size 2 != parallelism.dp * tp * pp = 1 * 1 * 1 = 1"),
        ([f"data.prepared_dir={tmp_path / 'none'}"], f"error: data.prepared_dir {tmp_path / 'none'} does not exist"),
        ([], f"error: checkpoint {ckpt} was saved with other settings; config keys that differ from the "
             "checkpoint's (saved -> now): parallelism.dp_sync 'sparseloco' -> 'allreduce'"),
    ]:
        assert launch_with(base + overrides) == 2 and not started, overrides
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(expected), err
    for overrides, torchrun, module in [
        (["parallelism.dp_sync=sparseloco"], (), "nanotron_ext.train"),  # resumes with the same settings
        ([f"checkpoints.dir={tmp_path / 'fresh'}"], ("--nnodes=1:2", "--nproc_per_node=2"),
         "nanotron_ext.train"),  # elastic: the world size (2 or 4) is not known before the rendezvous; 2 fits
        (["model.hiden_size=64"], (), "nanotron_ext.data"),  # not the trainer: its own checks
    ]:
        assert launch_with(base + overrides, *torchrun, module=module) == 0 and len(started) == 1, overrides
