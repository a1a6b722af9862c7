"""Atomic, sharded, resumable checkpoints.

A trainer needs two calls:

    save_checkpoint(root, step, ctx, model=..., optimizer=..., scheduler=..., extra=..., keep_last=k)
    path = latest_checkpoint(root)
    extra = load_checkpoint(path, ctx, model=..., optimizer=..., scheduler=...) if path else None

On-disk layout (every rank writes its own file, named by its (pp, dp, tp) coordinates):

    root/step_<N>/meta.json            step, dp/tp/pp, files with sizes and sha256, versions
    root/step_<N>/pp0_dp1_tp0.pt       one rank: model shard, optimizer, scheduler, RNG, extra

Atomicity: a checkpoint is written into `root/step_<N>.tmp-<token>/` and only renamed to
`step_<N>/` by rank 0 after every rank's file is complete and `meta.json` is written. A folder
counts as a checkpoint only if its name is exactly `step_<N>` and its meta.json lists files that
exist with the recorded sizes, so a crash at any point leaves at most a `.tmp-`/`.old-` folder,
which the next save removes.

Where `root` is: by default every rank sees the same `root` (one node, or a shared filesystem). With
`hosts=CheckpointHosts.agree(group, per_host=True)` hosts share no disk: `root` is each host's own folder (the same
path on each machine). The lowest
rank of each host (torchrun's GROUP_RANK, its node rank) plays rank 0's part for that host's folder: its temp
folder, its `meta.json` (its own files, plus `hosts`: every host's file records) and its rename. A step is complete
when every host's rename succeeded, agreed over the process group; older checkpoints are pruned only after that,
so a crash between two hosts' renames always leaves the previous step on every host (`agreed_checkpoint` picks
the newest step complete everywhere). Resharding a checkpoint to a different dp/tp/pp layout is out of scope:
loading checks the layout and refuses a different one.

Every rank writes a full file, DP replicas included (dp copies of each model shard on disk). This
is deliberate: replicas are not guaranteed identical in this project (SparseLoCo/DiLoCo-style
methods keep per-replica weights and error-feedback state; ZeRO-style optimizers shard state over
DP), each rank restores exactly the bytes it had, which makes resume bit-exact without any
"who owns what" bookkeeping or broadcast at load time. Disk cost is acceptable at our scale.

Files are read with `torch.load(weights_only=True)`: every state we write is tensors, numbers,
strings, bytes, None, lists, tuples and dicts. RNG states are converted to such types (numpy's key
array becomes a list of ints), so no pickled code is ever executed on load. `extra` must follow the
same rule; save checks it up front and names the offending key.

The handful of control messages (temp-folder name, per-rank results) go through
`torch.distributed` directly on `world_pg`, not `nanotron.distributed`, so they do not show up
in the communication ledger that measures training traffic.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.distributed as torch_dist
from torch import nn

from nanotron_ext import __version__
from nanotron_ext.fileio import sha256_file
from nanotron_ext.train.agreement import gather_or_raise
from nanotron_ext.train.checkpoint_hosts import CheckpointHosts, agreed_checkpoint, missing_shard
from nanotron_ext.train.checkpoint_store import (
    META_NAME,
    CheckpointError,
    PathLike,
    check_loadable,
    fsync_dir,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    remove_checkpoint,
    remove_dir,
    remove_stale,
)
from nanotron_ext.train.rng_state import get_rng_state, set_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointHosts",
    "agreed_checkpoint",
    "Stateful",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "read_meta",
    "remove_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> Any: ...




# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def _layout(parallel_context: Any) -> Dict[str, int]:
    return {
        "dp": int(parallel_context.data_parallel_size),
        "tp": int(parallel_context.tensor_parallel_size),
        "pp": int(parallel_context.pipeline_parallel_size),
    }


def _fmt_layout(layout: Dict[str, int]) -> str:
    return f"dp={layout['dp']} tp={layout['tp']} pp={layout['pp']}"


def _coords(parallel_context: Any) -> Dict[str, int]:
    pp, dp, tp = parallel_context.get_3d_ranks(torch_dist.get_rank())
    return {"pp": int(pp), "dp": int(dp), "tp": int(tp)}


def _shard_name(coords: Dict[str, int]) -> str:
    return f"pp{coords['pp']}_dp{coords['dp']}_tp{coords['tp']}.pt"


def _failed_on(what: str) -> Callable[[List[Tuple[int, str]]], CheckpointError]:
    """`gather_or_raise`'s `raise_as` for checkpoints: one CheckpointError naming every failed rank."""
    def raise_as(failed: List[Tuple[int, str]]) -> CheckpointError:
        # one line, bounded: torch's load_state_dict lists every missing key on lines of their own
        detail = "; ".join(f"rank {r}: {' '.join(e.split())[:300]}" for r, e in failed)
        return CheckpointError(f"{what} failed on {len(failed)} rank(s): {detail}")
    return raise_as


def _error_line(e: Optional[BaseException]) -> Optional[str]:
    return None if e is None else f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------
def _write_shard(tmp_dir: Path, payload: Dict[str, Any], name: str) -> Dict[str, Any]:
    part = tmp_dir / f"{name}.part"
    try:
        with open(part, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        # torch.save reports a full disk as "unexpected pos ..."; the OSError is only in the chain
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), None)
        if cause is None:
            raise
        raise CheckpointError(f"cannot write {part}: {cause.strerror or cause} (errno {cause.errno}); free space "
                              "there or set checkpoints.dir to a writable folder with room") from e
    final = tmp_dir / name
    os.replace(part, final)
    # Hashing re-reads the file (from page cache, normally) rather than buffering the whole
    # serialised shard in memory twice.
    return {"name": name, "bytes": final.stat().st_size, "sha256": sha256_file(final)}


def _finalize(root: Path, tmp_dir: Path, final: Path, meta: Dict[str, Any]) -> Optional[Path]:
    """A host's leader: meta.json and the atomic rename; returns the displaced earlier folder of this step."""
    meta_part = tmp_dir / f"{META_NAME}.part"
    with open(meta_part, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(meta_part, tmp_dir / META_NAME)
    fsync_dir(tmp_dir)

    # Re-saving an existing step (e.g. the final save after resuming at the end): move the old one
    # out of the step_<N> namespace first; rename cannot replace a non-empty directory.
    displaced = None
    if final.exists():
        displaced = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(final, displaced)
    try:
        os.replace(tmp_dir, final)  # the commit point
    except BaseException:
        if displaced is not None:  # put the previous checkpoint of this step back
            os.replace(displaced, final)
        raise
    fsync_dir(root)
    return displaced


def _prune(root: Path, final: Path, displaced: Optional[Path], keep_last: Optional[int]) -> None:
    """A host's leader, once every host's part of `final` is in place: the displaced folder, checkpoints beyond
    `keep_last` (never `final`) and leftovers of interrupted saves."""
    try:
        if displaced is not None:
            shutil.rmtree(displaced)
        if keep_last is not None:
            complete = list_checkpoints(root)
            keep = {p for _, p in complete[-keep_last:]} | {final}  # never the one just written
            for _, p in complete:
                if p not in keep:
                    remove_dir(p)
        remove_stale(root)
    except OSError as e:  # the new checkpoint is complete; failing to prune must not stop training
        logger.warning("checkpoint %s is complete but pruning %s failed: %s", final, root, e)


def save_checkpoint(
    root: PathLike,
    step: int,
    parallel_context: Any,
    *,
    model: nn.Module,
    optimizer: Optional[Stateful] = None,
    scheduler: Optional[Stateful] = None,
    extra: Optional[Dict[str, Any]] = None,
    keep_last: Optional[int] = None,
    config: Optional[Dict[str, Any]] = None,
    hosts: Optional[CheckpointHosts] = None,
) -> Path:
    """Write `root/step_<step>/` atomically; collective: every rank of the world must call it.

    Each rank saves its model shard, optimizer and scheduler state, its torch/numpy/python (and
    CUDA) RNG states and `extra` (data-loader state, counters: tensors, numbers, strings, lists,
    dicts). With `keep_last`, older complete checkpoints beyond the newest `keep_last` are deleted
    afterwards (never the one just written), as are leftovers of interrupted saves. Returns the
    checkpoint folder on every rank; raises CheckpointError on every rank if any rank failed.
    `config` (the run configuration as a dict) goes into meta.json, to name what changed if a resume fails.
    `hosts`: which rank handles which folder (None: one folder every rank sees; per host: module doc).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(root)
    group = parallel_context.world_pg
    hosts = hosts if hosts is not None else CheckpointHosts.shared(group)
    tmp_dir = _open_folder(root, step, group, hosts)
    records = _write_own_shard(tmp_dir, step, parallel_context, hosts, model=model, optimizer=optimizer,
                               scheduler=scheduler, extra=extra)
    final = root / f"step_{int(step)}"
    displaced = _commit(root, tmp_dir, final, _meta(step, parallel_context, records, hosts, config), group, hosts)
    if hosts.is_leader:
        _prune(root, final, displaced, keep_last)
    return final


def _open_folder(root: Path, step: int, group: Any, hosts: CheckpointHosts) -> Path:
    """Phase 1: each host's leader creates its temp folder and tells everyone its name (which also orders every
    write after the mkdir). Leftovers of earlier crashes go first, so a full disk gets room."""
    folder, error = None, None
    if hosts.is_leader:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root)
            tmp_dir = root / f"step_{int(step)}.tmp-{uuid.uuid4().hex[:12]}"
            tmp_dir.mkdir()
            folder = str(tmp_dir)
        except OSError as e:
            error = _error_line(e)
    folders = gather_or_raise(error, group, _failed_on(f"creating a checkpoint folder under {root}"), value=folder)
    return Path(folders[hosts.leader_rank])


def _write_own_shard(tmp_dir: Path, step: int, parallel_context: Any, hosts: CheckpointHosts, *, model: nn.Module,
                     optimizer: Optional[Stateful], scheduler: Optional[Stateful],
                     extra: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Phase 2: every rank writes its own file; every rank's file record (the temp folder goes when one failed)."""
    coords = _coords(parallel_context)
    record: Optional[Dict[str, Any]] = None
    local_error: Optional[BaseException] = None
    try:
        payload = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "rank": torch_dist.get_rank(),
            "coords": coords,
            "layout": _layout(parallel_context),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": get_rng_state(),
            "extra": dict(extra) if extra is not None else {},
        }
        check_loadable(payload, "checkpoint")
        record = {**_write_shard(tmp_dir, payload, _shard_name(coords)), "rank": payload["rank"], **coords}
    except Exception as e:  # reported to all ranks below, so no rank waits for a file that never comes
        local_error = e
    try:
        return gather_or_raise(_error_line(local_error), parallel_context.world_pg,
                               _failed_on(f"writing checkpoint step {step}"), value=record, cause=local_error)
    except CheckpointError:
        if hosts.is_leader:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _meta(step: int, parallel_context: Any, records: List[Dict[str, Any]], hosts: CheckpointHosts,
          config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A host's meta.json: its own ranks' file records (and, per host, every host's)."""
    def on(host: int) -> List[Dict[str, Any]]:
        return sorted((rec for r, rec in enumerate(records) if hosts.hosts[r] == host), key=lambda rec: rec["rank"])

    meta = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "layout": _layout(parallel_context),
        "world_size": torch_dist.get_world_size(parallel_context.world_pg),
        "files": on(hosts.host),
        "nanotron_ext_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "config": config,
    }
    if hosts.per_host:
        meta["host"] = hosts.host
        meta["hosts"] = {str(h): on(h) for h in sorted(set(hosts.hosts))}
    return meta


def _commit(root: Path, tmp_dir: Path, final: Path, meta: Dict[str, Any], group: Any,
            hosts: CheckpointHosts) -> Optional[Path]:
    """Phase 3: each host's leader commits its part; everybody learns every host's verdict, so on return the
    checkpoint is complete on every host (only then is anything pruned). Returns, on a leader, the displaced earlier
    folder of this step."""
    displaced: Optional[Path] = None
    local_error: Optional[BaseException] = None
    if hosts.is_leader:
        try:
            displaced = _finalize(root, tmp_dir, final, meta)
        except Exception as e:
            local_error = e
            shutil.rmtree(tmp_dir, ignore_errors=True)
    gather_or_raise(_error_line(local_error), group, _failed_on(f"committing checkpoint {final}"), cause=local_error)
    return displaced


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------
def load_checkpoint(
    path: PathLike,
    parallel_context: Any,
    *,
    model: nn.Module,
    optimizer: Optional[Stateful] = None,
    scheduler: Optional[Stateful] = None,
    verify: bool = True,
) -> Dict[str, Any]:
    """Restore this rank's state from checkpoint folder `path`; collective. Returns its `extra`.

    The checkpoint's dp/tp/pp must equal the current layout (resharding is not supported). With
    `verify`, the file's sha256 is checked against meta.json. Model, optimizer and scheduler are
    loaded in place; RNG states are restored last, so nothing in between consumes randomness.
    Raises CheckpointError on every rank if any rank failed.
    """
    path = Path(path)
    meta = read_meta(path)
    saved, current = meta["layout"], _layout(parallel_context)
    if {k: int(saved[k]) for k in ("dp", "tp", "pp")} != current:
        raise CheckpointError(
            f"checkpoint {path} was saved with layout {_fmt_layout(saved)} but this run uses "
            f"{_fmt_layout(current)}; resharding a checkpoint to another layout is not supported: "
            f"resume with {_fmt_layout(saved)}, or start without this checkpoint"
        )

    coords = _coords(parallel_context)
    name = _shard_name(coords)
    payload: Optional[Dict[str, Any]] = None
    local_error: Optional[BaseException] = None
    try:
        entry = next((e for e in meta["files"] if e["name"] == name), None)
        if entry is None:
            raise CheckpointError(missing_shard(path, meta, name, coords))
        file = path / name
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, {META_NAME} says {entry['bytes']}")
        if verify and sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{file} does not match the sha256 in {META_NAME} (corrupted?)")
        # map_location=cpu: load_state_dict copies into the live tensors' devices, so loading to
        # CPU avoids a second full copy on the accelerator.
        payload = torch.load(file, map_location="cpu", weights_only=True)
        if payload["coords"] != coords:
            raise CheckpointError(f"{file} holds coordinates {payload['coords']}, expected {coords}")
        model.load_state_dict(payload["model"])
        if optimizer is not None:
            if payload["optimizer"] is None:
                raise CheckpointError(f"{file} has no optimizer state")
            optimizer.load_state_dict(payload["optimizer"])
        if scheduler is not None:
            if payload["scheduler"] is None:
                raise CheckpointError(f"{file} has no scheduler state")
            scheduler.load_state_dict(payload["scheduler"])
    except Exception as e:
        local_error = e
    gather_or_raise(_error_line(local_error), parallel_context.world_pg, _failed_on(f"loading checkpoint {path}"),
                    cause=local_error)
    assert payload is not None
    set_rng_state(payload["rng"])
    return payload["extra"]
