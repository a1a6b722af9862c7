"""Each system at its best layout on a hardware: planned once per (system, tp, pp), reshaped per layout, replayed.

A plan (nanotron_ext.bench.clock: the config's ranks stepped on the meta device) is made per system and (tp, pp) at
a reference dp and micro-batch split, then reshaped to each layout without planning again, since per micro-batch a
rank's FLOPs, TP and stage bytes scale with the tokens in it, and its DP payload (the gradients, or the outer sync)
does not depend on dp or the micro-batches (`reshape`; tests/test_advise.py holds a reshaped plan to a planned one).

Three bounds per layout, from the clock's replay: `upper` (no overlap: how this project's trainer runs, blocking
sends, the DP all-reduce after the flush, a blocking outer sync), `ddp` (blocking sends, the per-step DP all-reduce
bucketed behind the backward as torch DDP does it) and `lower` (full overlap). The headline is the bound the system's
best trainer achieves: `ddp` for a per-step all-reduce (torch DDP is what its best user runs), `upper` for an outer
loop whose sync blocks, and for a streaming outer sync (`sparseloco.streaming.delay` tau) in one job too: its
trainer's step's agreements over the DP tier (the logged loss's mean over the replicas) queue on that link behind
the sync in flight, so no step gains (measured: reproduce/wan/results/cpu_clock_validation.md, tau 4 at blocking's
step). `lower` (the sync behind tau inner steps only) heads a streaming system only where the DP tier carries no
per-step agreement (the clock validation's rule, nanotron_ext/bench/wan/validate.py `trainer_bound`).
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.advise.hardware import Hardware, clock_link
from nanotron_ext.advise.layouts import RULES, Layout, Rule, dp_link, layouts, stage_links
from nanotron_ext.bench.clock import ddp_step_s, planned, replica_works, step_bounds, twin_overrides

GIB = 2 ** 30
PER_MICRO_GROUPS = ("tp", "pp")  # ledger groups whose traffic is per micro-batch (DP's is per step)


@dataclasses.dataclass(frozen=True)
class Priced:
    """One layout of one system, priced: its step bounds (s), the headline's, the peak memory of its ranks."""

    system: str
    layout: Layout
    lower_s: float
    ddp_s: float
    upper_s: float
    headline: str  # "ddp" | "upper" | "lower" (a streaming outer sync with nothing else on the DP tier)
    peak_gib: float
    fits: bool
    agreements_s: float = 0.0  # the step's agreements over the DP tier: in `upper` and `ddp`, not in `lower`

    @property
    def step_s(self) -> float:
        return getattr(self, f"{self.headline}_s")


def _scale_ops(ledger: Dict[str, Any], f_bytes: float, f_calls: float) -> None:
    for group in PER_MICRO_GROUPS:
        for v in ledger.get(group, {}).values():
            v["bytes"] = v["bytes"] * f_bytes
            v["calls"] = v["calls"] * f_calls


def reshape(plan: Dict[str, Any], layout: Layout, bf16_gradients: bool = False) -> Dict[str, Any]:
    """`plan` (made at some dp, micro-batch size and count) as `layout` would run it (module docstring): FLOPs and
    TP / stage traffic per step scaled by the tokens per replica step and the micro-batches, the DP payload kept
    (none at dp = 1; halved for bf16 gradients), every replica on planned replica 0 unless the plan has as many."""
    out = copy.deepcopy(plan)
    m0, mbs0 = plan["micro_batches"], plan["micro_batch_size"]
    f_tokens = layout.micro_batches * layout.micro_batch_size / (m0 * mbs0)
    f_calls = layout.micro_batches / m0
    for column in out["inner"] + (out["outer"] or []):
        for rank in column:
            rank["flops"] *= f_tokens
            _scale_ops(rank["ledger"], f_tokens, f_calls)
            peak = rank["peak"]
            per_micro = (peak.get("Activation", 0) + peak.get("Temp", 0)) * (layout.micro_batch_size / mbs0 - 1)
            peak["Total"] = peak["Total"] + per_micro
            dp_ops = rank["ledger"].get("dp", {})
            if layout.dp == 1:
                rank["ledger"]["dp"] = {}
            for op, v in dp_ops.items():
                if "control" in op:
                    continue
                if bf16_gradients and op == "all_reduce":  # the gradients (fp32 in the plan)
                    v["bytes"] = v["bytes"] / 2
                # several stages on one node: their DP rings share its uplink (the clock shares it by tp only)
                v["bytes"] = v["bytes"] * layout.busiest_node_slots
    out["layout"] = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    out["micro_batches"] = layout.micro_batches
    out["micro_batch_size"] = layout.micro_batch_size
    if len(out["inner"]) == 1:
        out["replica_of"] = {str(r): 0 for r in range(layout.dp)}
    return out


def bounds(plan: Dict[str, Any], hw: Hardware, layout: Layout) -> Dict[str, float]:
    """The three bounds of a reshaped plan on `hw` at `layout`'s placement."""
    tiers = {"tp": clock_link(hw.node_link, hw.duplex), "dp": clock_link(dp_link(hw, layout), hw.duplex)}
    stage = [clock_link(link, hw.duplex, hw.latency_holds_wire and link == hw.internet_link)
             for link in stage_links(hw, layout)]
    works = replica_works(plan, tiers, stage, hw.tflops * 1e12)
    b = step_bounds(works, plan["outer_every"], plan.get("outer_overlap", 0))
    return {"lower_s": b.lower_s, "ddp_s": max(ddp_step_s(works, plan["outer_every"]), b.lower_s),
            "upper_s": b.upper_s, "agreements_s": b.agreements_s}


@dataclasses.dataclass
class Planner:
    """Plans per (system, tp, pp), cached in `cache` (a plan is the same on every hardware: links do not change
    it). `config`/`overrides_of` give a system's YAML and keys (the WAN meter's), `scale` the model and batch."""

    scale: str
    cache: Path
    config_of: Any  # system -> (config file, overrides)
    made: Dict[Any, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    used: set = dataclasses.field(default_factory=set)  # the cache's file names the plans came from

    def _twin(self, system: str, rule: Rule, tp: int, pp: int, reference: Dict[str, int]) -> Any:
        config, overrides = self.config_of(rule.plan_as or system)
        dp = rule.dp or 2  # a per-step system is planned at dp 2 (its DP payload is per rank, any dp >= 2)
        m = max(reference["micro_batches"], pp)
        layout = [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
                  f"tokens.micro_batch_size={reference['micro_batch_size']}",
                  f"tokens.batch_accumulation_per_replica={m}"]
        return config, twin_overrides(config, overrides, self.scale) + layout

    def plan(self, system: str, rule: Rule, tp: int, pp: int, reference: Dict[str, int]) -> Dict[str, Any]:
        key = (rule.plan_as or system, tp, pp)
        if key not in self.made:
            from nanotron_ext.bench.clock import plan_path
            from nanotron_ext.config.loader import load_config

            config, twin = self._twin(system, rule, tp, pp, reference)
            self.made[key] = {**planned(config, twin, self.cache), "micro_batch_size": reference["micro_batch_size"]}
            self.used.add(plan_path(load_config(config, twin), self.cache).name)
        return self.made[key]

    def state_floor_bytes(self, system: str, rule: Rule, tp: int, pp: int, reference: Dict[str, int]) -> float:
        """A floor under the busiest rank's memory, without planning: AdamW's 16 bytes per parameter (fp32
        weights, gradients and two moments, as the planner counts them) over tp x pp ranks (the busiest rank holds
        at least the average)."""
        key = ("params", rule.plan_as or system)
        if key not in self.made:
            from nanotron_ext.config.loader import load_config
            from nanotron_ext.models.param_count import count_params

            config, twin = self._twin(system, rule, tp, rule.pp or 1, reference)
            self.made[key] = {"n": count_params(load_config(config, twin))}
        return 16.0 * self.made[key]["n"] / (tp * pp)


def price(planner: Planner, hw: Hardware, system: str, layout: Layout, reference: Dict[str, int]) -> Priced:
    rule = RULES[system]
    plan = planner.plan(system, rule, layout.tp, layout.pp, reference)
    shaped = reshape(plan, layout, bf16_gradients=rule.bf16_gradients)
    # a streaming rule planned as its blocking twin (whose config has delay 0) takes its delay from the rule
    shaped["outer_overlap"] = rule.outer_overlap or plan.get("outer_overlap", 0)
    b = bounds(shaped, hw, layout)
    peak = max(rank["peak"]["Total"] for column in shaped["inner"] + (shaped["outer"] or []) for rank in column)
    streams = shaped["outer_overlap"] and not b["agreements_s"]  # nothing queues behind the sync on the DP tier
    headline = ("lower" if streams else "upper") if rule.outer_loop else "ddp"
    return Priced(system, layout, b["lower_s"], b["ddp_s"], b["upper_s"], headline, peak / GIB,
                  peak <= hw.device_gib * GIB, b["agreements_s"])


def best(planner: Planner, hw: Hardware, system: str, reference: Dict[str, int], num_layers: int,
         candidates: Optional[Sequence[Layout]] = None) -> List[Priced]:
    """Every layout of `system` that fits, fastest headline step first (the first is its best layout)."""
    rule = RULES[system]
    global_sequences = reference["dp"] * reference["micro_batches"] * reference["micro_batch_size"]
    todo = candidates if candidates is not None else layouts(hw, rule, global_sequences,
                                                             reference["micro_batch_size"], num_layers)
    floor = lambda lay: planner.state_floor_bytes(system, rule, lay.tp, lay.pp, reference)  # noqa: E731
    priced = [price(planner, hw, system, lay, reference) for lay in todo if floor(lay) <= hw.device_gib * GIB]
    return sorted((p for p in priced if p.fits), key=lambda p: p.step_s)
