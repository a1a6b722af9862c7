"""What the model clock replays for one system on one preset: its ranks planned, then priced on the preset's hardware.

1. The twin (`twin_overrides`): the system's layout and techniques (dp x tp x pp, TP strategy, codec, DP sync) at
   the preset's model and batch (`ClockPreset.scale_config`: hidden size, layers, heads, vocabulary, sequence,
   micro-batches), every width a technique sets scaled with the hidden size (SM's k = d/8 stays d/8, ResBM's 128x
   stays 128x, BOOST's r = d/4 stays d/4). Without a scale config the system is timed as it trains.
2. The plan (`planned`): the planner (nanotron_ext.plan) steps each distinct replica's pipeline column, TP rank 0,
   on the meta device over torch's fake process group: per rank the FLOPs of the step (torch's FlopCounterMode) and
   the comm ledger's bytes and calls per (group, op). A DP sync with an outer loop is planned twice, an inner and an
   outer step: what the outer step sends beyond the inner one is the outer sync.
3. The price (`replica_works`): per stage, forward = 1/3 and backward = 2/3 of the stage's FLOPs per micro-batch at
   the device's effective throughput (Narayanan et al.'s 1:2 split of a matmul's forward and backward), plus the
   stage's TP collectives on the TP link, half in each pass; the stage's `send:fwd` / `send:bwd` bytes per
   micro-batch times tp (one uplink per node carries every TP rank's share); per stage the DP tier's ring on the DP
   link with the node's tp rings sharing its uplink; the outer step's broadcast from the first stage to the later
   ones (heterogeneous SparseLoCo's embedding fold) on the replica's stage link, added to its outer sync
   (`stage_broadcast_s`); the DP tier's few-byte agreements (CONTROL_BYTES or fewer per
   call: the logged loss) as latency in the no-overlap bound; a rank's "update_flops" (`with_update_flops`: what an
   optimiser such as Muon adds once per step, the plan less its AdamW twin) as the stage's once-per-step update, at
   the preset's update rate, outside the micro-batches. Left out, and said: the world and pipeline groups'
   agreements (not delayed by the emulator either), pipeline headers (they travel just ahead of their tensor) and
   compute that FlopCounterMode does not count (elementwise work: norms, optimiser, SparseLoCo's top-k).

Values the planner cannot know (data-dependent sizes: MAPL's distinct token ids) are planned at their smallest
(nanotron_ext.plan.rank), heterogeneous SparseLoCo's folded embedding entries at their bound
(sparseloco.accounting.fold_entries_bound); the meter's table prints the planned bytes beside each tier's closed
form.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.bench.clock.replay import Link, ReplicaWork, Stage, ring_seconds, steady_bounds, step_bounds
from nanotron_ext.registry import techniques

SCALE_KEYS = ("model.hidden_size", "model.ffn_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
              "model.vocab_size", "model.max_seq_len", "model.dtype", "tokenizer.vocab_size",
              "tokens.sequence_length", "tokens.micro_batch_size", "tokens.batch_accumulation_per_replica")
TIERS = ("tp", "pp", "dp")
CONTROL_BYTES = 64  # per call: an agreement flag, a loss or a gradient norm, not a tensor the step moves
# in plan caches: 2 = step-gated work tagged apart and the embedding fold at its bound (issue 39); plans of 1 are stale
PLANNER_VERSION = 2


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def width_keys() -> List[str]:
    """The widths that scale with the hidden size: every registered technique's `Technique.widths`."""
    return [key for t in techniques() for key in t.widths]


def twin_overrides(config_file: str, overrides: Sequence[str], scale_config: Optional[str]) -> List[str]:
    """The overrides that time `config_file` + `overrides` at `scale_config`'s model and batch (module docstring)."""
    from nanotron_ext.config.loader import load_config

    sets = [*overrides, "parallelism.link.enabled=false"]
    if not scale_config:
        return sets
    small, big = load_config(config_file, list(overrides)), load_config(scale_config, [])
    factor = big.model.hidden_size / small.model.hidden_size
    sets += [f"{k}={_get(big, k)}" for k in SCALE_KEYS]
    for key in width_keys():
        value = _get(small, key)
        if isinstance(value, int) and not isinstance(value, bool):
            sets.append(f"{key}={max(1, round(value * factor))}")
    return sets


def plan_path(cfg: Any, cache: Path, device: str = "cpu") -> Path:
    """Where `planned` caches the plan of a loaded config: keyed by the part of the resolved config a plan depends on
    (nanotron_ext.plan.cache_key states the rule), the device and the planner's version
    (reproduce/paper_scale_plans.py names the plans its table read by this)."""
    from nanotron_ext.config.digest import digest
    from nanotron_ext.config.loader import config_to_dict
    from nanotron_ext.plan.cache_key import plan_defining

    key = digest({"plan": plan_defining(config_to_dict(cfg)), "device": device, "planner": PLANNER_VERSION}, 16)
    return cache / f"plan_{key}.json"


def planned(config_file: str, overrides: Sequence[str], cache: Path, device: str = "cpu") -> Dict[str, Any]:
    """The plan of one config (module docstring, 2.), read back from `cache` when a plan of the same resolved config,
    device and planner version is there: {"layout", "micro_batches", "schedule", "outer_every", "outer_overlap" (the
    streaming sync's delay, read from the config, never from the cache), "replica_of" (dp rank
    -> planned replica), "inner": [per planned replica, per stage: rank plan], "outer": the same for the outer step
    or None}; a cached plan not of that form (damaged, NaN) is planned again, said in one line
    (nanotron_ext.plan.cached). `device` "cpu" (the default): FLOPs as the CPU kernels count them, the runs the meter
    trains and the model clock's committed results; "cuda" differs only for fp32 attention with grouped KV heads
    (CUDA's math fallback, nanotron_ext.plan.kernels), by about 1.5% of the FLOPs at the meter's model."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.config.tiers import replica_codecs
    from nanotron_ext.fileio import write_text_atomic
    from nanotron_ext.plan.cached import read_cached_plan
    from nanotron_ext.plan.run import column, default_ranks, plan_ranks, rank_of
    from nanotron_ext.registry import DP_SYNCS

    cfg = load_config(config_file, list(overrides))
    path = plan_path(cfg, cache, device)
    p = cfg.parallelism
    saved = read_cached_plan(path, {"dp": p.dp, "tp": p.tp, "pp": p.pp})  # a damaged one: one line, planned again
    overlap = DP_SYNCS.owner(p.dp_sync).outer_overlap(cfg)  # not planned: read from the config every time
    if saved is not None:
        return {**saved, "outer_overlap": overlap}
    groups = [replicas for replicas, _ in replica_codecs(cfg).values()]
    firsts = sorted(replicas[0] for replicas in groups)
    replica_of = {r: replicas[0] for replicas in groups for r in replicas}
    ranks = default_ranks(cfg)
    every = DP_SYNCS.owner(p.dp_sync).outer_every(cfg)

    def by_replica(plans: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
        at = {q["rank"]: q for q in plans}
        return [[at[r] for r in column(cfg, rank_of(cfg, 0, first, 0))] for first in firsts]

    result = {"layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp},
              "micro_batches": cfg.tokens.batch_accumulation_per_replica, "schedule": p.pp_engine,
              "outer_every": every if every > 1 else 0,
              "replica_of": {str(r): firsts.index(f) for r, f in replica_of.items()},
              "inner": by_replica(plan_ranks(config_file, list(overrides), cfg, ranks, outer=every <= 1,
                                             device=device)),
              "outer": by_replica(plan_ranks(config_file, list(overrides), cfg, ranks, device=device))
              if every > 1 else None}
    cache.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result) + "\n")
    return {**result, "outer_overlap": overlap}


def _ops(ledger: Dict[str, Any], group: str, minus: Optional[Dict[str, Any]] = None,
         prefix: str = "", control: bool = False) -> Dict[str, Tuple[float, float]]:
    """{op: (bytes, calls)} of one group's ops starting with `prefix`, less what `minus` has of the same op;
    control messages (CONTROL_BYTES or fewer per call: flags, a loss, a norm) left out, or with `control` only
    those."""
    out = {}
    for op, c in ledger.get(group, {}).items():
        if not op.startswith(prefix):
            continue
        base = (minus or {}).get(group, {}).get(op, {"bytes": 0, "calls": 0})
        nbytes, calls = c["bytes"] - base["bytes"], c["calls"] - base["calls"]
        if calls > 0 and nbytes > 0 and (nbytes <= CONTROL_BYTES * calls) == control:
            out[op] = (float(nbytes), float(calls))
    return out


def _sent(ledger: Dict[str, Any], direction: str) -> float:
    return float(ledger.get("pp", {}).get(f"send:{direction}", {}).get("bytes", 0))


def stage_broadcast_s(outer: Dict[str, Any], inner: Dict[str, Any], stages: int, tp: int, link: Link) -> float:
    """Seconds of the outer step's collectives on the pipeline group that the inner step has not (heterogeneous
    SparseLoCo's embedding fold: the first stage broadcasts the outer step's entries to the later stages) over the
    replica's stage link: each of the stages - 1 copies leaves the first stage's node, every TP rank's broadcast
    (each on its own pipeline group) sharing that node's uplink, one latency per call."""
    ops = {op: v for op, v in _ops(outer, "pp", minus=inner).items() if not op.startswith(("send", "recv"))}
    if stages < 2 or not ops:
        return 0.0
    nbytes, calls = sum(b for b, _ in ops.values()), sum(c for _, c in ops.values())
    return (stages - 1) * tp * link.transmit_s(nbytes) + calls * link.latency_s


def replica_works(plan: Dict[str, Any], links: Dict[str, Link], stage_link: Sequence[Link],
                  flops_per_s: float, update_flops_per_s: float = 0.0) -> List[ReplicaWork]:
    """One ReplicaWork per DP replica (module docstring, 3.): `links` the "tp" and "dp" tiers' links, `stage_link[r]`
    replica r's link between its stages, `flops_per_s` the device's effective throughput. A rank's "update_flops"
    (`with_update_flops`: work done once per optimiser step) leave its micro-batches and become the stage's
    `update_s`, priced at `update_flops_per_s` (0: at `flops_per_s`)."""
    lay, m = plan["layout"], plan["micro_batches"]
    tp, dp = lay["tp"], lay["dp"]
    works = []
    for r in range(dp):
        index = plan["replica_of"][str(r)]
        inner = plan["inner"][index]
        outer = plan["outer"][index] if plan["outer"] else None
        stages, dp_s, outer_s, control_s, update_s = [], [], [], [], []
        for s, rank in enumerate(inner):
            tp_s = ring_seconds({op: (b / m, c / m) for op, (b, c) in _ops(rank["ledger"], "tp").items()}, tp,
                                links["tp"])
            update = float(rank.get("update_flops", 0.0))
            update_s.append(update / (update_flops_per_s or flops_per_s))
            compute = (rank["flops"] - update) / m / flops_per_s
            stages.append(Stage(compute / 3 + tp_s / 2, 2 * compute / 3 + tp_s / 2,
                                tp * _sent(rank["ledger"], "fwd") / m, tp * _sent(rank["ledger"], "bwd") / m))
            dp_s.append(ring_seconds(_ops(rank["ledger"], "dp"), dp, links["dp"], sharing=tp))
            control_s.append(ring_seconds(_ops(rank["ledger"], "dp", control=True), dp, links["dp"]))
            if outer is not None:
                extra = _ops(outer[s]["ledger"], "dp", minus=rank["ledger"])
                outer_s.append(ring_seconds(extra, dp, links["dp"], sharing=tp))
        if outer is not None:  # after the DP exchange, the first stage's broadcast to the later ones (the fold)
            fold_s = stage_broadcast_s(outer[0]["ledger"], inner[0]["ledger"], len(inner), tp, stage_link[r])
            outer_s = [t + fold_s for t in outer_s]
        works.append(ReplicaWork(stages, [stage_link[r]] * (len(stages) - 1), m, plan["schedule"], dp_s, outer_s,
                                 control_s, update_s))
    return works


def with_update_flops(plan: Dict[str, Any], twin: Dict[str, Any]) -> Dict[str, Any]:
    """`plan` with each rank's "update_flops": its FLOPs less those of the same rank of `twin`, the same model,
    layout and batch under an optimiser whose update FlopCounterMode counts as nothing (AdamW's elementwise update):
    what `plan`'s optimiser adds once per step (Muon's Newton-Schulz), which the clock then prices once per step,
    outside the micro-batch schedule. ValueError when the two differ in layout or the difference is negative."""
    if plan["layout"] != twin["layout"] or len(plan["inner"]) != len(twin["inner"]):
        raise ValueError(f"the twin's layout {twin['layout']} is not the plan's {plan['layout']}")
    inner = []
    for column, base in zip(plan["inner"], twin["inner"]):
        ranks = []
        for rank, other in zip(column, base):
            extra = rank["flops"] - other["flops"]
            if extra < 0:
                raise ValueError(f"rank {rank['rank']}: the twin computes more than the plan ({extra} FLOPs)")
            ranks.append({**rank, "update_flops": extra})
        inner.append(ranks)
    return {**plan, "inner": inner}


def bytes_per_step(plan: Dict[str, Any]) -> Dict[str, float]:
    """Bytes each tier carries per optimiser step, all ranks (the outer sync amortised over its cycle): every
    planned rank stands for the tp ranks of its stage and the replicas that share its config."""
    lay = plan["layout"]
    counts = replica_counts(plan)
    out = {t: 0.0 for t in TIERS}
    for index, column in enumerate(plan["inner"]):
        for s, rank in enumerate(column):
            weight = counts[index] * lay["tp"]
            for tier in TIERS:
                prefix = "send" if tier == "pp" else ""
                out[tier] += weight * sum(b for b, _ in _ops(rank["ledger"], tier, prefix=prefix).values())
            if plan["outer"]:
                extra = _ops(plan["outer"][index][s]["ledger"], "dp", minus=rank["ledger"])
                out["dp"] += weight * sum(b for b, _ in extra.values()) / plan["outer_every"]
    return out


def tier_link(spec: Sequence[float], duplex: str, held: bool = False) -> Link:
    """A preset's (Mbit/s, one-way ms) or, for a datacenter tier under NCCL's collective model, (bus Mbit/s, ms per
    ring step, ms per call: hardware.py's `_collective`) as the clock's Link."""
    return Link(spec[0], spec[1], duplex, held, call_ms=spec[2] if len(spec) > 2 else 0.0)


def links_of(preset: Any, dp: int) -> Tuple[Dict[str, Link], List[Link]]:
    """A ClockPreset's tier links and each of `dp` replicas' stage link (its placement)."""
    held = getattr(preset, "latency_holds_wire", False)
    stage = [tier_link(preset.datacenter_stage, preset.duplex) if r in preset.datacenter_replicas
             else tier_link(preset.stage, preset.duplex, held) for r in range(dp)]
    return {"tp": tier_link(preset.tp, preset.duplex), "dp": tier_link(preset.dp, preset.duplex)}, stage


def replica_counts(plan: Dict[str, Any]) -> List[int]:
    """How many DP replicas each planned replica config stands for (a rank plan counts once per replica sharing its
    config, times tp)."""
    return [list(plan["replica_of"].values()).count(i) for i in range(len(plan["inner"]))]


def free_step_s(plan: Dict[str, Any], flops_per_s: float) -> float:
    """The clock's step over free links: compute and the schedule's bubbles only."""
    free = Link(0.0)
    return step_bounds_of(plan, {"tp": free, "dp": free}, [free] * plan["layout"]["dp"], flops_per_s).upper_s


def step_bounds_of(plan: Dict[str, Any], tiers: Dict[str, Link], stage: Sequence[Link], flops_per_s: float,
                   steady: bool = False, update_flops_per_s: float = 0.0) -> Any:
    """The clock's StepBounds of a planned config over these links at this throughput: one flushed step, or with
    `steady` the pipeline's steady state (replay.steady_bounds)."""
    works = replica_works(plan, tiers, stage, flops_per_s, update_flops_per_s)
    return (steady_bounds if steady else step_bounds)(works, plan["outer_every"], plan.get("outer_overlap", 0))
