"""The systems ranked on a hardware at their best layouts, by predicted time to target.

time to target = steps to target (penalties.py: dense's steps x the system's penalty, from loss runs) x the step of
its best layout (search.py: the bound its best trainer achieves, with the full-overlap and no-overlap bounds beside).
The committed model clock's own layout (dp 2 x tp 2 x pp 2 over every node) is ranked beside as `SYSTEM (committed
layout)`, so a reader sees what the best layout changed.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.advise.hardware import Hardware
from nanotron_ext.advise.layouts import RULES, Layout, place
from nanotron_ext.advise.penalties import DENSE, Steps
from nanotron_ext.advise.search import Planner, Priced, best, price

COMMITTED = {"dense_3d"}  # systems also shown at the committed model clock's layout


def meter_config(system: str) -> Tuple[str, List[str]]:
    """A system's YAML and keys as the WAN meter's loss runs train it (nanotron_ext/bench/wan/systems.py)."""
    from nanotron_ext.bench.wan.systems import run_overrides, system_config

    args = argparse.Namespace(config="reproduce/wan/cpu_base.yaml", steps=1000, val_every=20, inner_steps=20,
                              set=[], tp_preset="nvlink")
    return str(system_config(system, args)), run_overrides(system, None, 1, args)


def reference_of(scale: str) -> Tuple[Dict[str, int], int]:
    """The loss runs' step at the scale config's model: dp 2 replicas (the meter's layouts) of its micro-batches."""
    from nanotron_ext.config.loader import load_config

    cfg = load_config(scale, [])
    return ({"dp": 2, "micro_batches": cfg.tokens.batch_accumulation_per_replica,
             "micro_batch_size": cfg.tokens.micro_batch_size}, cfg.model.num_layers)


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One row: a system at a layout, its step bounds and time to target (s; None without a loss run)."""

    name: str
    label: str
    priced: Optional[Priced]
    steps: Optional[Steps]
    dense_steps: float

    @property
    def time_s(self) -> Optional[float]:
        return self.bound_time("step_s")

    def bound_time(self, attr: str) -> Optional[float]:
        if self.priced is None or self.steps is None:
            return None
        return self.steps.penalty * self.dense_steps * getattr(self.priced, attr)

    def as_dict(self, hw: Hardware) -> Dict[str, Any]:
        p, s = self.priced, self.steps
        return {"system": self.name, "label": self.label,
                "layout": p.layout.describe(hw) if p else None,
                "layout_keys": dataclasses.asdict(p.layout) if p else None,
                "step_s": {"headline": p.step_s, "bound": p.headline, "lower": p.lower_s, "ddp": p.ddp_s,
                           "upper": p.upper_s} if p else None,
                "peak_gib": p.peak_gib if p else None,
                "steps_to_target": s.penalty * self.dense_steps if s else None,
                "penalty": s.penalty if s else None, "penalty_is_lower_bound": s.lower_bound if s else None,
                "losses_from": s.source if s else "no loss run of this system",
                "time_to_target_s": self.time_s,
                "time_to_target_bounds_s": [self.bound_time("lower_s"), self.bound_time("upper_s")]}


def steps_of(steps: Dict[str, Steps], system: str) -> Optional[Steps]:
    """A system's steps to target: its own loss runs', or those of the system whose math it has (Rule.steps_as),
    said in the source."""
    if system in steps:
        return steps[system]
    twin = RULES[system].steps_as
    if twin and twin in steps:
        s = steps[twin]
        return dataclasses.replace(s, source=f"{twin}'s ({s.source}); bf16 gradient reduction itself not loss-run")
    return None


def committed_layout(hw: Hardware, reference: Dict[str, int]) -> Optional[Layout]:
    """The committed model clock's dp 2 x tp 2 x pp 2 over 4 nodes, where the hardware has them."""
    if hw.nodes < 4:
        return None
    return Layout(2, hw.gpus_per_node, 2, reference["micro_batch_size"], reference["micro_batches"],
                  place(hw, 2, 2, None, hw.gpus_per_node))


def rank(hw: Hardware, scale: str, cache: Path, steps: Dict[str, Steps], systems: Sequence[str] = tuple(RULES),
         planner: Optional[Planner] = None) -> List[Ranked]:
    """Every system at its best layout (and the committed one beside), fastest to target first; systems with no
    loss run, or no layout that fits, last."""
    reference, layers = reference_of(scale)
    planner = planner or Planner(scale, cache, meter_config)
    dense_steps = steps[DENSE].dense_steps if DENSE in steps else 1.0
    rows = []
    for system in systems:
        found = best(planner, hw, system, reference, layers)
        rows.append(Ranked(system, RULES[system].label, found[0] if found else None, steps_of(steps, system),
                           dense_steps))
        lay = committed_layout(hw, reference) if system in COMMITTED else None
        if lay is not None:
            rows.append(Ranked(f"{system} (committed layout)", RULES[system].label,
                               price(planner, hw, system, lay, reference), steps_of(steps, system), dense_steps))
    return sorted(rows, key=lambda r: (r.time_s is None, r.time_s or 0.0))


def render(hw: Hardware, rows: Sequence[Ranked]) -> str:
    """The ranking as text: one line per system, then where each system's losses come from."""
    head = f"{'#':>2}  {'system':<34} {'to target h':>11} {'[full, no overlap]':>18} {'step s':>8}  best layout"
    out = [f"hardware {hw.name}: {hw.nodes} nodes x {hw.gpus_per_node} GPUs ({hw.datacenter_nodes} in the "
           f"datacenter), {hw.tflops:g} TFLOP/s, {hw.device_gib:g} GiB; internet {hw.internet_link[0]:g} Mbit/s + "
           f"{hw.internet_link[1]:g} ms", head]
    for i, r in enumerate(rows, 1):
        t, lo, hi = r.time_s, r.bound_time("lower_s"), r.bound_time("upper_s")
        mark = ">=" if r.steps and r.steps.lower_bound else ""
        when = f"{mark}{t / 3600:.2f}" if t is not None else "-"
        span = f"[{lo / 3600:.2f}, {hi / 3600:.2f}]" if t is not None else ""
        step = f"{r.priced.step_s:.3f}" if r.priced else "-"
        where = r.priced.layout.describe(hw) if r.priced else "no layout fits"
        out.append(f"{i:>2}  {r.name:<34} {when:>11} {span:>18} {step:>8}  {where}")
    out.append("losses: " + "; ".join(f"{r.name}: {r.steps.source if r.steps else 'no loss run'}" for r in rows
                                      if "(committed" not in r.name))
    return "\n".join(out)
