"""Checkpoints of a job whose hosts share no disk (checkpoints.storage=per_host; checkpoint.py's module doc): which
host each rank is on, the rank that handles each host's folder, the step every host can resume from, and why a rank
finds no shard of its own on its host's disk. Control messages only (object gathers on the world group, outside the
comm ledger), as in checkpoint.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as torch_dist

from nanotron_ext.train.agreement import gather_objects, gather_or_raise, host_index
from nanotron_ext.train.checkpoint_store import META_NAME, CheckpointError, PathLike, list_checkpoints


@dataclass(frozen=True)
class CheckpointHosts:
    """Where a job's checkpoints go: one folder every rank sees (`per_host` False: every rank counts as host 0,
    rank 0 handles it), or each host's own disk (checkpoints.storage=per_host). `hosts[r]`: rank r's host."""

    per_host: bool
    hosts: List[int]
    rank: int

    @classmethod
    def shared(cls, group: Any) -> "CheckpointHosts":
        """One folder for every rank of `group` (no message)."""
        return cls(False, [0] * torch_dist.get_world_size(group), torch_dist.get_rank(group))

    @classmethod
    def of(cls, nodes: List[int], per_host: bool, rank: int) -> "CheckpointHosts":
        """From every rank's node rank, already gathered (`nodes`), and checkpoints.storage."""
        return cls(per_host, list(nodes) if per_host else [0] * len(nodes), rank)

    @classmethod
    def agree(cls, group: Any, per_host: bool) -> "CheckpointHosts":
        """Collective over `group` when `per_host` (every rank's host), else `shared`."""
        if not per_host:
            return cls.shared(group)
        return cls.of(gather_objects(host_index(), group), True, torch_dist.get_rank(group))

    @property
    def host(self) -> int:
        return self.hosts[self.rank]

    @property
    def leader_rank(self) -> int:
        """The rank that handles the folder of this rank's host: the lowest rank on it."""
        return min(r for r, h in enumerate(self.hosts) if h == self.host)

    @property
    def is_leader(self) -> bool:
        return self.leader_rank == self.rank


def agreed_checkpoint(root: PathLike, group: Any, hosts: CheckpointHosts,
                      pick: Callable[[], Optional[Path]]) -> Optional[Path]:
    """The checkpoint every rank of `group` (the world) resumes from (collective), given `pick`, which returns the
    one this rank's host would pick (or raises CheckpointError: a damaged newer one): on one shared `root`, its
    answer; per host, the newest step complete on every host (a crash between two hosts' renames leaves the newest
    on some only, and the one before on all). A host with none while another has some is a CheckpointError naming
    it: starting afresh would overwrite the others' checkpoints. A host's refusal reaches every rank (none waits in
    the gather)."""
    if not hosts.per_host:
        return pick()
    try:
        local, refusal = pick(), None
    except CheckpointError as e:
        local, refusal = None, f"node {host_index()}: {e}"
    steps = sorted(s for s, _ in list_checkpoints(root)) if local is not None else []
    steps = [s for s in steps if local is None or s <= int(local.name.split("_")[1])]  # (a damaged newer: refused)
    seen = gather_or_raise(refusal, group, lambda failed: CheckpointError(failed[0][1]), value=(host_index(), steps))
    by_host: Dict[int, set] = {}
    for host, host_steps in seen:
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
