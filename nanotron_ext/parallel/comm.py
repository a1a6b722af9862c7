"""Byte accounting for everything that crosses a process boundary.

Patch 0007 makes `nanotron.distributed` report each collective and point-to-point call as
(op, nbytes, group, peer). The ledger below turns those reports into counters keyed by the
process group's role ("tp", "pp", "dp", ...) and the operation ("all_reduce", "send:fwd", ...).

Bytes are the payload handed to the call on this rank (the tensor size, as the papers' tables
count it), not the algorithm's wire traffic (a ring all-reduce of N bytes puts 2(p-1)/p * N on
each link).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, Optional, Tuple

import nanotron.distributed as dist


@dataclasses.dataclass
class CommCount:
    bytes: int = 0
    calls: int = 0


class CommLedger:
    """Counters of communicated bytes and calls per (group role, operation)."""

    def __init__(self) -> None:
        self.counts: Dict[Tuple[str, str], CommCount] = {}
        self._group_names: Dict[int, str] = {}
        self._tags: list[str] = []

    # -- naming -----------------------------------------------------------------------------
    def name_group(self, group: Optional[dist.ProcessGroup], name: str) -> None:
        """Give `group` a role name; the first name given to a group wins (tp before world)."""
        if group is not None:
            self._group_names.setdefault(id(group), name)

    def group_name(self, group: Optional[dist.ProcessGroup]) -> str:
        if group is None:
            return "world"
        return self._group_names.get(id(group), "other")

    @contextlib.contextmanager
    def tag(self, tag: str) -> Iterator[None]:
        """Calls inside are recorded as `op:tag` (e.g. send:fwd, send:meta)."""
        self._tags.append(tag)
        try:
            yield
        finally:
            self._tags.pop()

    # -- recording --------------------------------------------------------------------------
    def record(self, op: str, nbytes: int, group: Optional[dist.ProcessGroup], peer: Optional[int] = None) -> None:
        if group is not None and group.size() == 1:
            return  # a one-rank group crosses no process boundary
        if self._tags:
            op = f"{op}:{self._tags[-1]}"
        count = self.counts.setdefault((self.group_name(group), op), CommCount())
        count.bytes += int(nbytes)
        count.calls += 1

    # -- reading ----------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """{group: {op: {"bytes": b, "calls": c}}}, a copy."""
        out: Dict[str, Dict[str, Dict[str, int]]] = {}
        for (group, op), c in sorted(self.counts.items()):
            out.setdefault(group, {})[op] = {"bytes": c.bytes, "calls": c.calls}
        return out

    def bytes(self, group: Optional[str] = None, op: Optional[str] = None) -> int:
        """Total bytes, optionally restricted to a group role and/or an op (prefix match: "send" covers "send:fwd")."""
        return sum(c.bytes for (g, o), c in self.counts.items() if _match(g, o, group, op))

    def calls(self, group: Optional[str] = None, op: Optional[str] = None) -> int:
        return sum(c.calls for (g, o), c in self.counts.items() if _match(g, o, group, op))

    def bytes_per_group(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for (g, _), c in self.counts.items():
            out[g] = out.get(g, 0) + c.bytes
        return out

    def reset(self) -> None:
        self.counts.clear()


def _match(g: str, o: str, group: Optional[str], op: Optional[str]) -> bool:
    return (group is None or g == group) and (op is None or o == op or o.startswith(op + ":"))


_LEDGER: Optional[CommLedger] = None


def get_ledger() -> CommLedger:
    """The process-wide ledger, hooked into nanotron.distributed on first use."""
    global _LEDGER
    if _LEDGER is None:
        _LEDGER = CommLedger()
        dist.register_comm_hook(_LEDGER.record)
    return _LEDGER
