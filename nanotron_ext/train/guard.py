"""Run-folder ownership (one live job per run folder and per checkpoint folder) and resume advice.

`claim_folders` locks each folder with `fileio.lock_folder` (an exclusive `flock` on `<folder>/.lock`, which
the kernel drops however the process ends, so it is never stale) and keeps the files open for the life of
the process.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from nanotron_ext.errors import TrainingError
from nanotron_ext.fileio import FolderInUseError, lock_folder
from nanotron_ext.registry import techniques
from nanotron_ext.train.checkpoint import list_checkpoints, remove_checkpoint
from nanotron_ext.train.checkpoint_store import CheckpointMetaError, saved_config

logger = logging.getLogger(__name__)

def claim_folders(run_dir: Path, checkpoint_dir: Path, resume: str) -> List[IO[str]]:
    """Lock both folders (keep the returned files open) and apply `checkpoints.resume` to existing checkpoints.

    resume=never refuses a folder that already holds checkpoints (they would be overwritten, pruned, or later
    auto-resumed as if they were this run's). resume=overwrite deletes nothing here: the trainer deletes them
    once its own first checkpoint is complete (`remove_other_checkpoints`), so a launch that fails before that
    (bad data, a crash) loses nothing.
    """
    try:
        locks = [lock_folder(run_dir, "run folder", "another general.run")]
    except FolderInUseError as e:
        raise TrainingError(str(e)) from None
    if checkpoint_dir.resolve() != run_dir.resolve():  # flock on one file twice from one process would clash
        return locks + claim_checkpoint_folder(checkpoint_dir, resume)
    _refuse_to_overwrite(checkpoint_dir, resume)
    return locks


def claim_checkpoint_folder(checkpoint_dir: Path, resume: str) -> List[IO[str]]:
    """The checkpoint folder's part of `claim_folders` (also each other host's, with checkpoints.storage=per_host:
    its own disk's folder)."""
    try:
        locks = [lock_folder(checkpoint_dir, "checkpoint folder", "another checkpoints.dir")]
    except FolderInUseError as e:
        raise TrainingError(str(e)) from None
    _refuse_to_overwrite(checkpoint_dir, resume)
    return locks


def _refuse_to_overwrite(checkpoint_dir: Path, resume: str) -> None:
    existing = list_checkpoints(checkpoint_dir)
    if existing and resume == "never":
        names = ", ".join(p.name for _, p in existing)
        raise TrainingError(f"checkpoints.dir {checkpoint_dir} holds checkpoints ({names}) and checkpoints.resume="
                            "never would overwrite or prune them: set checkpoints.resume=auto to continue that run, "
                            "checkpoints.resume=overwrite to delete them and start afresh, or use "
                            "another checkpoints.dir")


def remove_other_checkpoints(checkpoint_dir: Path, keep: Path) -> List[Path]:
    """Delete every complete checkpoint in `checkpoint_dir` but `keep` (resume=overwrite, after the first save);
    returns what was deleted. A checkpoint that cannot be deleted is left, with a warning: training goes on."""
    removed = []
    for _, p in list_checkpoints(checkpoint_dir):
        if p.resolve() != Path(keep).resolve():
            try:
                remove_checkpoint(p)
                removed.append(p)
            except OSError as e:
                logger.warning("checkpoints.resume=overwrite: could not delete the earlier checkpoint %s: %s", p, e)
    return removed


def exit_with_launcher(grace_s: float = 10.0) -> Callable[[], None]:
    """End this worker promptly when its launcher (torchrun) dies, even by SIGKILL; returns `stop`, which ends
    the watchdog (call it on the way out: no thread should be left running at interpreter exit).

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
    stopped = threading.Event()

    def watch() -> None:
        while os.getppid() == parent:
            if stopped.wait(0.5):
                return
        os.kill(os.getpid(), signal.SIGTERM)
        if not stopped.wait(grace_s):
            os._exit(143)

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=5)

    return stop


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


# The core's keys a resume must not change: they shape the saved state (a change makes the checkpoint unloadable:
# size mismatch, missing keys) or define what the run continues (the codec, the layout, the DP sync): a change there
# used to give per-rank tracebacks or, worse, continue silently as another experiment. Each key covers the keys
# under it. Every registered technique adds its own (Technique.resume_keys: by default, its sections).
_RESUME_KEYS = ("model", "optimizer.name", "parallelism.dp", "parallelism.tp", "parallelism.pp",
                "parallelism.layers_per_stage", "parallelism.dp_sync")
_RESUME_FREE = ("model.attention",)  # the same math by another kernel (techniques add theirs: resume_free)


def _under(key: str, paths: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in paths)


def _resume_rules() -> Tuple[List[str], List[str]]:
    """(the keys whose change refuses a resume, those under them that may change): the core's and every registered
    technique's (Technique.resume_defining, Technique.resume_free)."""
    defining, free = list(_RESUME_KEYS), list(_RESUME_FREE)
    for technique in techniques():
        defining += technique.resume_defining()
        free += technique.resume_free
    return defining, free


def changed_keys(saved: Dict[str, Any], config: Dict[str, Any]) -> List[str]:
    """'key saved -> now' for each resume-defining key of `config` that differs from the `saved` config."""
    a, b = _flat(saved), _flat(config)
    defining, free = _resume_rules()
    return [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and _under(k, defining) and not _under(k, free)]


def resume_conflict(path: Union[str, Path], config: Dict[str, Any]) -> Optional[str]:
    """Why the run configured by `config` must not resume from checkpoint `path`, or None: the resume-defining
    keys that differ from the ones it was saved with (checkpoints written before configs were recorded: None)."""
    try:
        saved = saved_config(path)
    except CheckpointMetaError as e:  # its config cannot be compared: resuming it would be a guess
        return (f"{e} (damaged?): this run cannot tell whether it may resume from {path}; {resume_advice(path)}; or "
                "start afresh with checkpoints.resume=overwrite or another checkpoints.dir")
    diffs = changed_keys(saved, config) if saved else []
    if not diffs:
        return None
    return (f"checkpoint {path} was saved with other settings; config keys that differ from the checkpoint's (saved "
            f"-> now): {', '.join(diffs)}; set them back to resume, or start afresh with checkpoints.resume=overwrite "
            "or another checkpoints.dir")


def resume_advice(path: Union[str, Path], config: Optional[Dict[str, Any]] = None) -> str:
    """What to do when checkpoint `path` cannot be loaded: the state-shaping config keys that differ from
    the ones it was saved with, and the previous complete checkpoint with how to resume from it."""
    path = Path(path)
    advice = []
    try:
        saved = saved_config(path)
    except CheckpointMetaError:
        saved = None
    if saved and config:
        diffs = changed_keys(saved, config)
        if diffs:
            advice.append(f"config keys that differ from the checkpoint's (saved -> now): {', '.join(diffs)}; set them "
                          "back to resume, or start afresh with checkpoints.resume=overwrite or "
                          "another checkpoints.dir")
    m = re.fullmatch(r"step_(\d+)", path.name)
    older = [p for s, p in list_checkpoints(path.parent) if m and s < int(m.group(1))]
    if older:
        advice.append(f"the previous complete checkpoint is {older[-1]}: to resume from it, move {path} out of the "
                      f"way (e.g. mv {path} {path}.bad) and launch again")
    else:
        advice.append(f"there is no earlier complete checkpoint in {path.parent}")
    return "; ".join(advice)
