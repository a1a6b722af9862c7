"""The regime map: which system reaches the target soonest, at its best layout, per model size, internet link and
datacenter share (`python -m nanotron_ext.advise.regime --out reproduce/wan/results/regime_map`).

The cluster: 16 nodes of 2 GPUs with 24 GiB each (A10G-class, the GPU of ResBM's and Protocol Models' runs) at the
ResBM-fitted 23 effective TFLOP/s (nanotron_ext/bench/clock/hardware.py), PCIe 4.0 x16 inside a node, InfiniBand NDR
between datacenter nodes, every other pair of nodes over the internet link (10 ms one way). Three sizes from the
papers' configs: 512M (heterogeneous SparseLoCo's: fits one node), 2B (ResBM's: one or a few nodes) and 7B (BOOST's
Llama 7B: pipelined over many nodes). Per cell the winner at its best layout, its margin over the runner-up at the
runner-up's best layout, and both times to target (steps: dense's steps x each system's penalty, from our loss runs,
or with `--papers` from the papers' published penalties: the second map).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.advise.hardware import Hardware
from nanotron_ext.advise.layouts import COMPOSED
from nanotron_ext.advise.penalties import REPO, Steps, penalties
from nanotron_ext.advise.ranking import Ranked, meter_config, rank
from nanotron_ext.advise.search import Planner
from nanotron_ext.parallel.link import LINK_PRESETS

SIZES = {"512M": "reproduce/het_sparseloco/sparseloco_512m.yaml", "2B": "reproduce/resbm/resbm_2b_baseline.yaml",
         "7B": "reproduce/boost/llama_7b_fullrank.yaml"}
LINKS_MBPS = (100, 200, 500, 1000, 2000, 5000, 10000)
SHARES = (0.0, 0.25, 0.5)
NODES, GPUS, DEVICE_GIB, TFLOPS, INTERNET_MS = 16, 2, 24.0, 23.0, 10.0
PCIE4 = (2.56e5, 0.005)  # PCIe 4.0 x16: 32 GB/s per direction, ~5 us (the WAN meter's boost-pcie-cpu anchor)
# the systems that decide the map: dense (fp32 / bf16 gradients), DiLoCo (plain / Nesterov), SparseLoCo, the composed
# jobs, and the single techniques of the composition
MAP_SYSTEMS = ("dense_3d", "dense_3d@bf16", "3d_diloco", "3d_diloco_nesterov", "3d_sparseloco", "3d_btp",
               "3d_sm", "3d_sm_sparseloco", "3d_btp_sparseloco", "three_tiers")


def cluster(mbps: float, share: float) -> Hardware:
    ib = LINK_PRESETS["infiniband"]
    return Hardware(f"16x2 A10G, {mbps:g} Mbit/s, {share:.0%} datacenter",
                    "advise.regime: 16 nodes x 2 A10G-class GPUs (24 GiB, 23 TFLOP/s effective, ResBM-fitted)",
                    NODES, GPUS, DEVICE_GIB, TFLOPS, round(share * NODES), PCIE4,
                    (ib.bandwidth_mbps, ib.latency_ms), (float(mbps), INTERNET_MS))


@dataclasses.dataclass(frozen=True)
class Cell:
    size: str
    mbps: float
    share: float
    winner: Optional[Ranked]
    runner_up: Optional[Ranked]

    @property
    def margin(self) -> Optional[float]:
        if self.winner is None or self.runner_up is None or not self.winner.time_s:
            return None
        return self.runner_up.time_s / self.winner.time_s

    def as_dict(self) -> Dict[str, Any]:
        def one(r: Optional[Ranked]) -> Any:
            if r is None:
                return None
            return {"system": r.name, "time_to_target_h": r.time_s / 3600, "step_s": r.priced.step_s,
                    "layout": dataclasses.asdict(r.priced.layout), "penalty": r.steps.penalty,
                    "penalty_is_lower_bound": r.steps.lower_bound}
        return {"size": self.size, "internet_mbps": self.mbps, "datacenter_share": self.share,
                "winner": one(self.winner), "runner_up": one(self.runner_up), "margin": self.margin,
                "composed_wins": bool(self.winner and self.winner.name in COMPOSED)}


def cells(steps: Dict[str, Steps], cache: Path, sizes: Sequence[str] = tuple(SIZES),
          links: Sequence[float] = LINKS_MBPS, shares: Sequence[float] = SHARES,
          systems: Sequence[str] = MAP_SYSTEMS) -> List[Cell]:
    """Every cell of the map (plans made once per size and reused across links and shares)."""
    out = []
    usable = [s for s in systems if s in steps or s.split("@")[0] in steps]
    for size in sizes:
        scale = str(REPO / SIZES[size])
        planner = Planner(scale, cache, meter_config)
        for share in shares:
            for mbps in links:
                rows = [r for r in rank(cluster(mbps, share), scale, cache, steps, usable, planner)
                        if r.time_s is not None and "(committed" not in r.name]
                out.append(Cell(size, mbps, share, rows[0] if rows else None, rows[1] if len(rows) > 1 else None))
    return out


def regime(papers: bool, cache: Path, **kw: Any) -> List[Cell]:
    return cells(penalties(papers=papers), cache, **kw)
