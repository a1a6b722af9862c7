"""Run-folder ownership (one live job per run folder and per checkpoint folder) and resume advice.

`claim_folders` takes an exclusive `fcntl.flock` on `<folder>/.lock` for each folder and keeps the
files open for the life of the process: the kernel drops the lock when the process ends, however it
ends (killed included), so a lock is never stale. The lock file names its holder for the error a
second launch gets.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Union

from nanotron_ext.errors import TrainingError
from nanotron_ext.train.checkpoint import list_checkpoints, read_meta, remove_checkpoint

LOCK_NAME = ".lock"


def lock_folder(folder: Path, what: str) -> IO[str]:
    """Lock `folder` (created if missing) or raise TrainingError naming the live holder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise TrainingError(f"{what} {folder} is in use by a running job ({holder}; lock {path}): wait for it to "
                            f"end or stop it, or launch with another {'general.run' if what == 'run folder' else 'checkpoints.dir'}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def claim_folders(run_dir: Path, checkpoint_dir: Path, resume: str) -> List[IO[str]]:
    """Lock both folders (keep the returned files open) and apply `checkpoints.resume` to existing checkpoints.

    resume=never refuses a folder that already holds checkpoints (they would be overwritten, pruned, or later
    auto-resumed as if they were this run's); resume=overwrite deletes them first, as asked.
    """
    locks = [lock_folder(run_dir, "run folder")]
    if checkpoint_dir.resolve() != run_dir.resolve():  # flock on one file twice from one process would clash
        locks.append(lock_folder(checkpoint_dir, "checkpoint folder"))
    existing = list_checkpoints(checkpoint_dir)
    if existing and resume == "never":
        names = ", ".join(p.name for _, p in existing)
        raise TrainingError(f"checkpoints.dir {checkpoint_dir} holds checkpoints ({names}) and checkpoints.resume="
                            "never would overwrite or prune them: set checkpoints.resume=auto to continue that run, "
                            "checkpoints.resume=overwrite to delete them and start afresh, or use another checkpoints.dir")
    if resume == "overwrite":
        for _, p in existing:
            remove_checkpoint(p)
    return locks


def exit_with_launcher(grace_s: float = 10.0) -> None:
    """End this worker promptly when its launcher (torchrun) dies, even by SIGKILL.

    torch elastic starts workers in their own sessions, so nothing else stops them: orphans would go on
    training beside a restarted job. SIGTERM comes from the kernel (PR_SET_PDEATHSIG, Linux) or from a
    watchdog thread that sees the parent pid change; after `grace_s` the watchdog exits hard (a rank
    blocked in a collective does not run Python signal handlers).
    """
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog alone

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(143)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


# Keys that shape the saved state: changing one makes a checkpoint unloadable (size mismatch, missing keys).
_STATE_KEYS = ("model.", "optimizer.name", "parallelism.dp", "parallelism.tp", "parallelism.pp")


def resume_advice(path: Union[str, Path], config: Optional[Dict[str, Any]] = None) -> str:
    """What to do when checkpoint `path` cannot be loaded: the state-shaping config keys that differ from
    the ones it was saved with, and the previous complete checkpoint with how to resume from it."""
    path = Path(path)
    advice = []
    try:
        saved = read_meta(path).get("config")
    except (OSError, ValueError):
        saved = None
    if saved and config:
        a, b = _flat(saved), _flat(config)
        diffs = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                 if k.startswith(_STATE_KEYS) and a.get(k) != b.get(k)]
        if diffs:
            advice.append(f"config keys that differ from the checkpoint's (saved -> now): {', '.join(diffs)}; set them "
                          "back to resume, or start afresh with checkpoints.resume=overwrite or another checkpoints.dir")
    m = re.fullmatch(r"step_(\d+)", path.name)
    older = [p for s, p in list_checkpoints(path.parent) if m and s < int(m.group(1))]
    if older:
        advice.append(f"the previous complete checkpoint is {older[-1]}: to resume from it, move {path} out of the "
                      f"way (e.g. mv {path} {path}.bad) and launch again")
    else:
        advice.append(f"there is no earlier complete checkpoint in {path.parent}")
    return "; ".join(advice)
