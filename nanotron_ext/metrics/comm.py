"""Communication volume of a step across all ranks, from each rank's ledger."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from nanotron import distributed as dist

from nanotron_ext.parallel.comm import CommLedger

GROUPS = ("tp", "pp", "dp", "ft", "mp", "world", "other")  # ft: fault-tolerant outer loops over torchft
# subsets of "pp" reported beside it: the pipeline's data messages per direction (activations to later
# stages, gradients to earlier ones), without nanotron's shape headers and the link clock; and a codec's
# once-per-step exchange of shared-parameter gradients per direction (MAPL)
PP_DATA = {("pp", f"send:{kind}{d}"): f"pp:send:{kind}{d}" for kind in ("", "codec_grads:") for d in ("fwd", "bwd")}
KEYS = GROUPS + tuple(PP_DATA.values())


def sent_bytes_by_group(ledger: CommLedger) -> Dict[str, int]:
    """This rank's bytes handed to the network per group: sends and collectives, not receives; plus the
    pipeline's data bytes per direction ("pp:send:fwd", "pp:send:bwd", already inside "pp")."""
    out = {g: 0 for g in KEYS}
    for (group, op), count in ledger.counts.items():
        if not op.startswith("recv"):
            out[group if group in GROUPS else "other"] += count.bytes
        if (group, op) in PP_DATA:
            out[PP_DATA[(group, op)]] += count.bytes
    return out


def total_sent_bytes(ledger: CommLedger, world_pg: dist.ProcessGroup,
                     device: Optional[torch.device] = None) -> Dict[str, int]:
    """Sum over all ranks of `sent_bytes_by_group` (one tiny all-reduce, itself counted under "world").
    `device`: the process group's device (NCCL reduces CUDA tensors only; default CPU, gloo)."""
    mine = sent_bytes_by_group(ledger)
    if world_pg.size() == 1:  # nothing to sum: no round trip through the device (a sync on CUDA every step)
        return {g: int(mine[g]) for g in KEYS if mine[g]}
    vec = torch.tensor([mine[g] for g in KEYS], dtype=torch.float64, device=device)
    dist.all_reduce(vec, group=world_pg)
    return {g: int(v) for g, v in zip(KEYS, vec.tolist()) if v}


LINK_TIERS = ("pp", "tp", "dp")


def link_wait_fractions(waited_s: Dict[str, float], step_s: float, cpu_s: float, world_pg: dist.ProcessGroup,
                        device: Optional[torch.device] = None) -> Tuple[Dict[str, float], List[float]]:
    """The fraction of a step each rank spent waiting on each tier's emulated links (`waited_s`: this rank's
    seconds this step, parallel/link.py), averaged over ranks, and every rank's CPU seconds of the step (`cpu_s`:
    its compute as one core per process would take it, whatever the machine's load: the WAN meter's compute
    check). One tiny all-gather, counted under "world"."""
    mine = torch.tensor([waited_s.get(t, 0.0) / step_s for t in LINK_TIERS] + [cpu_s], dtype=torch.float64,
                        device=device)
    rows = [mine]
    if world_pg.size() > 1:
        rows = [torch.empty_like(mine) for _ in range(world_pg.size())]
        dist.all_gather(rows, mine, group=world_pg)
    table = torch.stack(rows).cpu()
    fractions = {t: round(float(v), 6) for t, v in zip(LINK_TIERS, table[:, :-1].mean(0).tolist())}
    return fractions, [round(float(v), 6) for v in table[:, -1].tolist()]
