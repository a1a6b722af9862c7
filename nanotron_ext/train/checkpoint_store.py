"""The on-disk side of checkpoints: which folders are complete checkpoints, reading their meta,
removing them and the leftovers of interrupted saves, and the checks and fsyncs a save relies on.
The save/load protocol itself is in checkpoint.py."""
from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from nanotron_ext.errors import UserFacingError

logger = logging.getLogger(__name__)

META_NAME = "meta.json"
_COMPLETE_RE = re.compile(r"^step_(\d+)$")
# Leftovers of interrupted saves (.tmp-) and of replaced/pruned checkpoints being deleted (.old-).
_STALE_RE = re.compile(r"^step_\d+\.(tmp|old)-[0-9a-f]+$")


class CheckpointError(UserFacingError, RuntimeError):
    """A checkpoint that cannot be written or loaded; the message says which rank/file and why."""


class CheckpointMetaError(CheckpointError, ValueError):
    """A checkpoint's meta.json that is damaged (not JSON, not an object, a part of another type); the message names
    the file and the key. A ValueError: listing checkpoints skips such a folder as incomplete."""


PathLike = Union[str, os.PathLike]


def fsync_dir(path: Path) -> None:
    # Makes renames inside `path` durable; some filesystems refuse directory fsync, which is harmless.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder so that no crash leaves it looking complete."""
    remove_dir(Path(path))


def remove_dir(path: Path) -> None:
    """Rename out of the `step_<N>` namespace first, then delete: a crash mid-delete never leaves a
    half-deleted folder under a complete-looking name."""
    if _COMPLETE_RE.match(path.name):
        doomed = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(path, doomed)
        path = doomed
    shutil.rmtree(path)


def remove_stale(root: Path) -> None:
    for child in root.iterdir():
        if child.is_dir() and _STALE_RE.match(child.name):
            try:
                shutil.rmtree(child)
            except OSError as e:  # a leftover we cannot delete must not stop training
                logger.warning("could not remove stale checkpoint folder %s: %s", child, e)


_ALLOWED_LEAVES = (int, float, bool, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


def check_loadable(obj: Any, path: str) -> None:
    """Reject what `torch.load(weights_only=True)` would refuse, at save time and naming the key,
    instead of producing a checkpoint that cannot be loaded."""
    if type(obj) in (torch.Tensor, nn.Parameter) or isinstance(obj, _ALLOWED_LEAVES):
        if isinstance(obj, (np.generic,)):  # np.float64 subclasses float but is not loadable
            raise TypeError(f"checkpoint value {path} is a numpy {type(obj).__name__}; use .item()")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_loadable(v, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"checkpoint key {path}[{k!r}] has type {type(k).__name__}; use str/int keys")
            check_loadable(v, f"{path}[{k!r}]")
        return
    hint = " (use torch.from_numpy(...) or .tolist())" if isinstance(obj, np.ndarray) else ""
    raise TypeError(
        f"checkpoint value {path} has type {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"torch.load(weights_only=True) cannot read back; store tensors, numbers, strings, lists or dicts{hint}"
    )


def _meta_file(path: PathLike):  # type: ignore[no-untyped-def]
    from nanotron_ext.cli_checks import JsonFile

    return JsonFile(Path(path) / META_NAME, "checkpoint meta", CheckpointMetaError, max_bytes=2**28)


def read_meta(path: PathLike) -> Dict[str, Any]:
    """The parsed meta.json of a checkpoint folder (step, layout, files, versions): an object, else a
    CheckpointMetaError naming the file and what is wrong (missing, not JSON, another JSON value)."""
    return _meta_file(path).read_object()


def saved_config(path: PathLike) -> Optional[Dict[str, Any]]:
    """The run config a checkpoint was saved with (None: saved before configs were recorded); a meta.json whose
    config is not an object (a list, a number) is a CheckpointMetaError naming the file."""
    f = _meta_file(path)
    return f.need(read_meta(path), "config", dict, optional=True)


def _complete_problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None if it is. Cheap: stats, no hashing."""
    m = _COMPLETE_RE.match(path.name)
    if m is None or not path.is_dir():
        return "not a step_<N> folder"
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return f"unreadable {META_NAME}: {e}"
    try:
        if int(meta["step"]) != int(m.group(1)):
            return f"{META_NAME} says step {meta['step']}"
        for entry in meta["files"]:
            size = (path / entry["name"]).stat().st_size
            if size != entry["bytes"]:
                return f"{entry['name']} has {size} bytes, {META_NAME} says {entry['bytes']}"
    except (KeyError, TypeError, ValueError) as e:
        return f"malformed {META_NAME}: {e!r}"
    except OSError as e:
        return f"missing file: {e}"
    return None


def list_checkpoints(root: PathLike, skipped: Optional[List[Tuple[int, Path, str]]] = None) -> List[Tuple[int, Path]]:
    """Complete checkpoints under `root` as (step, path), oldest step first; the step_<N> folders that are not
    complete are skipped with a warning, or (`skipped` given) appended there as (step, path, why) for the caller's
    own one-line message (a command that refuses: the warning was a second line before its error)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _COMPLETE_RE.match(child.name)
        if m is None or not child.is_dir():
            continue
        problem = _complete_problem(child)
        if problem is None:
            found.append((int(m.group(1)), child))
        elif skipped is not None:
            skipped.append((int(m.group(1)), child, problem))
        else:
            logger.warning("skipping incomplete checkpoint %s: %s", child, problem)
    return sorted(found)


def damaged_after(found: List[Tuple[int, Path]],
                  skipped: List[Tuple[int, Path, str]]) -> Optional[Tuple[int, Path, str]]:
    """The newest step_<N> folder of `skipped` newer than every complete one of `found` (list_checkpoints'), or
    None: a checkpoint is written whole and then renamed into place, so such a folder is damage, not a save in
    progress (an interrupted prune leaves older ones)."""
    newest = found[-1][0] if found else -1
    later = sorted(s for s in skipped if s[0] > newest)
    return later[-1] if later else None


def latest_checkpoint(root: PathLike) -> Optional[Path]:
    """The complete checkpoint with the highest step under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# -- what a stop says it can resume from: beside latest_checkpoint, which answers it (train/replica.py and
# run_folder.py both say it; it lived in run_folder.py, which replica.py then imported only for this)
def resume_hint(checkpoint_dir: Union[str, Path], last: Optional[Path], earlier: Optional[Path] = None) -> str:
    """What a run that stopped can resume from: `last`, this run's newest complete checkpoint, or nothing; with
    `earlier` (checkpoints.resume=overwrite before this run's first checkpoint) the earlier run's, which is kept."""
    if last:
        return f"the last complete checkpoint is {last}"
    if earlier:
        return f"this run has no complete checkpoint yet; {kept_note(earlier)}"
    return f"there is no complete checkpoint in {checkpoint_dir}"


def kept_note(earlier: Path) -> str:
    """checkpoints.resume=overwrite stopped before its first checkpoint: the earlier run is whole."""
    return (f"the earlier run's {earlier} is kept with its records (checkpoints.resume=overwrite replaces them only "
            "at this run's first checkpoint): launch with checkpoints.resume=auto to continue it, or with overwrite "
            "to start afresh")
