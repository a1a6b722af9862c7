"""The regime map: which system reaches the target soonest, at its best layout, per model size, internet link and
datacenter share (`python -m nanotron_ext.advise.regime_map --out reproduce/wan/results/regime_map`).

The cluster is the `internet-1g` preset's hardware grown to 16 nodes: 2 A100-80GB per node at the presets' assumed
100 effective TFLOP/s on NVLink 3, InfiniBand NDR between datacenter nodes, every other pair of nodes over the
internet link (10 ms one way). Three sizes from the papers' configs: 512M (heterogeneous SparseLoCo's: fits one GPU),
2B (ResBM's: one node) and 7B (BOOST's Llama 7B: its AdamW state alone, 16 bytes per parameter, needs two or more
nodes). Per cell the winner at its best layout, its margin over the runner-up at the runner-up's best layout, and
both times to target (steps: dense's steps x each system's penalty, from our loss runs, or with `--losses papers`
from the papers' published losses: the second map).
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

SIZES = {"512M": "reproduce/het_sparseloco/sparseloco_512m.yaml", "2B": "reproduce/resbm/resbm_2b_baseline.yaml",
         "7B": "reproduce/boost/llama_7b_fullrank.yaml"}
LINKS_MBPS = (100, 200, 500, 1000, 2000, 5000, 10000)
SHARES = (0.0, 0.25, 0.5)
NODES, GPUS, DEVICE_GIB, INTERNET_MS = 16, 2, 80.0, 10.0
# the systems that decide the map (issue 51): dense (fp32 / bf16 gradients), DiLoCo (plain / Nesterov), the composed
# jobs (three tiers, heterogeneous SparseLoCo) and the single techniques of the composition on the TP and PP tiers,
# and DiLoCo's Nesterov and three tiers with the streaming outer sync (tau = 1). BTP + SparseLoCo (blocking or
# streaming) is not on the map: its plans at the map's sizes were never made (advise_plans/ has them for internet-1g)
MAP_SYSTEMS = ("dense_3d", "dense_3d@bf16", "3d_diloco", "3d_diloco_nesterov", "3d_btp", "3d_sm", "3d_sm_sparseloco",
               "three_tiers", "3d_diloco_nesterov_streaming", "three_tiers_streaming")


def cluster(mbps: float, share: float) -> Hardware:
    """16 nodes of internet-1g's hardware, `share` of them in the datacenter, `mbps` on the internet."""
    from nanotron_ext.bench.clock import A100_EFFECTIVE_TFLOPS, INFINIBAND, NVLINK3

    return Hardware(f"16x2 A100, {mbps:g} Mbit/s, {share:.0%} datacenter",
                    f"advise.regime: 16 nodes x 2 A100-80GB ({A100_EFFECTIVE_TFLOPS:g} TFLOP/s effective, assumed)",
                    NODES, GPUS, DEVICE_GIB, A100_EFFECTIVE_TFLOPS, round(share * NODES), NVLINK3, INFINIBAND,
                    (float(mbps), INTERNET_MS))


@dataclasses.dataclass(frozen=True)
class Cell:
    size: str
    mbps: float
    share: float
    winner: Optional[Ranked]
    runner_up: Optional[Ranked]
    unresolved: tuple = ()  # systems no run brought to the target whose lower-bound time beats the winner's

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
                "composed_wins": bool(self.winner and self.winner.name in COMPOSED),
                "unresolved": list(self.unresolved)}


def cells(steps: Dict[str, Steps], cache: Path, sizes: Sequence[str] = tuple(SIZES),
          links: Sequence[float] = LINKS_MBPS, shares: Sequence[float] = SHARES,
          systems: Sequence[str] = MAP_SYSTEMS, used: Optional[set] = None) -> List[Cell]:
    """Every cell of the map (plans made once per size and reused across links and shares); the cache's plan files
    it read are added to `used`."""
    out = []
    usable = [s for s in systems if s in steps or s.split("@")[0] in steps]
    for size in sizes:
        scale = str(REPO / SIZES[size])
        planner = Planner(scale, cache, meter_config)
        for share in shares:
            for mbps in links:
                ranked = [r for r in rank(cluster(mbps, share), scale, cache, steps, usable, planner)
                          if r.time_s is not None and "(committed" not in r.name]
                rows = [r for r in ranked if not r.steps.lower_bound]  # a winner needs a measured penalty
                win = rows[0] if rows else None
                open_ = tuple(r.name for r in ranked if r.steps.lower_bound and win and r.time_s < win.time_s)
                out.append(Cell(size, mbps, share, win, rows[1] if len(rows) > 1 else None, open_))
        if used is not None:
            used |= planner.used
    return out


def regime(source: str, cache: Path, **kw: Any) -> List[Cell]:
    """The map with steps from one loss-run set (penalties.sources())."""
    return cells(penalties(source), cache, **kw)
