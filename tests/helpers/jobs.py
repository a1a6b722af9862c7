"""Training jobs as users start them: `python -m nanotron_ext.launch` (the documented launcher) or plain torchrun,
as subprocesses, with helpers to wait for progress and to find the workers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "config_tiny_llama.yaml"


def job_cmd(nproc: int, overrides: List[str], *, launcher: str = "launch", config: Path = TINY) -> List[str]:
    """The command line of a training job: launcher "launch" (python -m nanotron_ext.launch) or "torchrun"."""
    head = ([sys.executable, "-m", "nanotron_ext.launch"] if launcher == "launch"
            else [str(Path(sys.executable).parent / "torchrun"), "--standalone"])
    return head + [f"--nproc_per_node={nproc}", "-m", "nanotron_ext.train", "--config-file", str(config)] + \
        [a for o in overrides for a in ("--set", o)]


def run_job(nproc: int, overrides: List[str], *, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd(nproc, overrides, **kw), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def start_job(nproc: int, overrides: List[str], **kw) -> subprocess.Popen:
    """A job in its own session (so a test can signal the whole group), stdout and stderr together."""
    return subprocess.Popen(job_cmd(nproc, overrides, **kw), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 180,
             poll: float = 0.1) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{out[-3000:]}")
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def workers(proc: subprocess.Popen) -> List[int]:
    """The launcher's worker processes (its children), by pid."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


def kill_job(proc: Optional[subprocess.Popen], pids: List[int] = ()) -> None:
    """Clean-up for a test's finally: the job's session and any worker named in `pids`."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
