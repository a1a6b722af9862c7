"""Checkpoints of a job whose hosts share no disk (checkpoints.storage=per_host; checkpoint.py's module doc): which
host each rank is on, the rank that handles each host's folder, the step every host can resume from, and why a rank
finds no shard of its own on its host's disk. Control messages only (object gathers on the world group, outside the
comm ledger), as in checkpoint.py."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as torch_dist

from nanotron_ext.train.checkpoint_store import META_NAME, CheckpointError, PathLike, list_checkpoints


def gather_objects(obj: Any, group: Any) -> List[Any]:
    """Every rank's `obj` (control messages: not training traffic, so not in the comm ledger)."""
    out: List[Any] = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(out, obj, group=group)
    return out


def host_index() -> int:
    """This process's host: torchrun's node rank (GROUP_RANK; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def hosts_of_ranks(group: Any, per_host: bool) -> List[int]:
    """Every rank's host (collective over `group`; all 0 when checkpoints are on one shared `root`)."""
    return gather_objects(host_index() if per_host else 0, group)


def host_leader(hosts: List[int], rank: int) -> int:
    """The rank that handles the folder of `rank`'s host: the lowest rank on it."""
    return min(r for r, h in enumerate(hosts) if h == hosts[rank])


def agreed_checkpoint(root: PathLike, parallel_context: Any, per_host: bool, pick: Callable[[], Optional[Path]]
                      ) -> Optional[Path]:
    """The checkpoint every rank resumes from (collective), given `pick`, which returns the one this rank's host
    would pick (or raises CheckpointError: a damaged newer one): on one shared `root`, its answer; per host, the
    newest step complete on every host (a crash between two hosts' renames leaves the newest on some only, and the
    one before on all). A host with none while another has some is a CheckpointError naming it: starting afresh
    would overwrite the others' checkpoints. A host's refusal reaches every rank (none waits in the gather)."""
    if not per_host:
        return pick()
    group = parallel_context.world_pg
    try:
        local, refusal = pick(), None
    except CheckpointError as e:
        local, refusal = None, str(e)
    steps = sorted(s for s, _ in list_checkpoints(root)) if local is not None else []
    steps = [s for s in steps if local is None or s <= int(local.name.split("_")[1])]  # (a damaged newer: refused)
    seen = gather_objects((host_index(), steps, refusal), group)
    refused = next(((host, why) for host, _, why in seen if why is not None), None)
    if refused is not None:
        raise CheckpointError(f"node {refused[0]}: {refused[1]}")
    by_host: Dict[int, set] = {}
    for host, host_steps, _ in seen:
        by_host.setdefault(host, set(host_steps))
    if not any(by_host.values()):
        return None
    common = set.intersection(*by_host.values())
    if not common:
        missing = sorted(h for h, s in by_host.items() if not s)
        have = {h: max(s) for h, s in by_host.items() if s}
        who = (f"node {', '.join(map(str, missing))} has no complete checkpoint in {root}" if missing else
               "no step is complete on every host (" + "; ".join(f"node {h}: {sorted(s)}" for h, s in
                                                          sorted(by_host.items())) + ")")
        raise CheckpointError(f"checkpoints.storage=per_host: {who}, while "
                              + ", ".join(f"node {h} has step_{s}" for h, s in sorted(have.items()))
                              + ": give every host its own checkpoints.dir back (each host keeps its --node-rank), "
                              "or empty every host's checkpoints.dir to start afresh")
    step = max(common)
    newer = sorted(h for h, s in by_host.items() if s and max(s) > step)
    if newer and torch_dist.get_rank(group) == 0:
        print(f"note: checkpoints.storage=per_host: node {', '.join(map(str, newer))} also has a step newer than "
              f"step_{step} that not every host completed (a save interrupted between hosts); resuming from "
              f"step_{step}", flush=True)
    return Path(root) / f"step_{step}"


def missing_shard(path: Path, meta: Dict[str, Any], name: str, coords: Dict[str, int]) -> str:
    """Why `path` has no file `name` for this rank: on another host (per-host storage), or not in the checkpoint."""
    holder = next((h for h, files in (meta.get("hosts") or {}).items() if name in {f["name"] for f in files}), None)
    if holder is not None:
        return (f"this host's folder holds node {meta.get('host')}'s shards, not {name} (node {holder}'s), and this "
                f"rank runs on node {host_index()}: launch each host with the --node-rank it had (--rdzv-backend "
                "static)")
    return f"{META_NAME} lists no file {name} for coordinates {coords}"
