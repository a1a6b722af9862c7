"""Communication volume of a step across all ranks, from each rank's ledger."""
from __future__ import annotations

from typing import Dict

import torch
from nanotron import distributed as dist

from nanotron_ext.parallel.comm import CommLedger

GROUPS = ("tp", "pp", "dp", "mp", "world", "other")


def sent_bytes_by_group(ledger: CommLedger) -> Dict[str, int]:
    """This rank's bytes handed to the network per group: sends and collectives, not receives."""
    out = {g: 0 for g in GROUPS}
    for (group, op), count in ledger.counts.items():
        if not op.startswith("recv"):
            out[group if group in out else "other"] += count.bytes
    return out


def total_sent_bytes(ledger: CommLedger, world_pg: dist.ProcessGroup) -> Dict[str, int]:
    """Sum over all ranks of `sent_bytes_by_group` (one tiny all-reduce, itself counted under "world")."""
    mine = sent_bytes_by_group(ledger)
    vec = torch.tensor([mine[g] for g in GROUPS], dtype=torch.float64)
    if world_pg.size() > 1:
        dist.all_reduce(vec, group=world_pg)
    return {g: int(v) for g, v in zip(GROUPS, vec.tolist()) if v}
