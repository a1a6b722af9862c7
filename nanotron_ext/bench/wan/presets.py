"""Calibrated link presets of the WAN meter: a real setting's communication / compute ratio, tier by tier,
scaled to this machine's compute.

A CPU step of the meter's model is ~10^4 times slower than a GPU step of a paper's model, so a real link's
bandwidth makes every tier look free. A calibrated preset instead keeps, on each tier, the ratio R of the
time the uncompressed traffic takes on the link to the compute time of a step, as in the real setting:

    bandwidth = (seconds the tier's uncompressed bytes take at 1 Mbit/s) / (R * C)   Mbit/s
    latency   = (real latency / real compute step) * C

with C and the bytes measured by one calibration run per tier of this machine's uncompressed system without
link emulation (pp: the pipeline, dp: the all-reduce data-parallel job, tp: Megatron TP), and the seconds
computed by the emulator's own closed forms (parallel/link.py: `ring_collective_s`; a stage link carries
forward and backward one after the other). R comes from one of two kinds of source:

- measured: the paper reports both step times (ProtocolNanoGPT's 100.5 s uncompressed vs 19.9 s compressed
  per step over 200 Mbit/s + 50 ms; ResBM Table 3's 609 vs 7530 tokens/s). Stage link only; the DP tier
  gets the same link.
- modelled: a paper-scale config of reproduce/ on a stated accelerator: R = the same closed forms applied to
  the config's bytes per tier (metrics.tier_bytes: the uncompressed layout's forms) at the real link, over
  6 N T / (pp tp) FLOPs per GPU per step at the stated effective TFLOP/s (bubbles, overlap and kernel
  efficiency beyond that one number are not modelled). R does not depend on our model's size; the
  comparison it buys is "which system wins when each tier costs what it costs there".
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from nanotron_ext.bench.clock import A100_EFFECTIVE_TFLOPS

REPO = Path(__file__).resolve().parents[3]
TIERS = ("tp", "pp", "dp")  # the bandwidth tiers, in the order every table prints them
TIER_KEYS = {"pp": "", "dp": "dp.", "tp": "tp."}  # each tier's prefix under parallelism.link
CALIBRATION_SYSTEM = {"pp": "pipeline", "dp": "ddp", "tp": "megatron_tp"}  # wan.SYSTEMS measured per tier


@dataclasses.dataclass(frozen=True)
class TierAnchor:
    """One tier of a real setting: its communication / compute time per step, its latency per second of
    compute, its duplex, and its unscaled link (Mbit/s, ms; what a dry run shows)."""

    comm_over_compute: float
    latency_ms_per_compute_s: float
    duplex: str
    unscaled: Tuple[float, float]


@dataclasses.dataclass(frozen=True)
class MeasuredAnchor:
    """A paper that measured both step times: its stage link's ratio (the DP tier gets the same link)."""

    source: str
    stands_for: str
    pp: TierAnchor

    def tiers(self) -> Dict[str, TierAnchor]:
        return {"pp": self.pp}


@dataclasses.dataclass(frozen=True)
class ModelledAnchor:
    """A paper-scale config of reproduce/ on a stated accelerator and links: each tier's ratio by closed form."""

    source: str
    stands_for: str
    config: str  # repo-relative YAML of the real model and layout
    overrides: Tuple[str, ...]  # to its uncompressed layout (what the calibration system measures here)
    tflops: float  # effective TFLOP/s per GPU (an assumption, stated in `source`)
    links: Mapping[str, Tuple[float, float, str]]  # tier -> (Mbit/s, one-way ms, duplex)

    def tiers(self) -> Dict[str, TierAnchor]:
        real = modelled_setting(self)
        c = real["compute_s"]
        return {tier: TierAnchor(real["comm_s"][tier] / c, ms / c, duplex, (mbps, ms))
                for tier, (mbps, ms, duplex) in self.links.items()}


Anchor = MeasuredAnchor | ModelledAnchor


def boost_node(tp_link: str, tp_mbps_ms: Tuple[float, float]) -> ModelledAnchor:
    """BOOST's Llama 7B at TP 4 x PP 2 under Megatron, its TP group on `tp_link`, Slingshot 11 between stages."""
    return ModelledAnchor(
        f"BOOST (arXiv:2512.12131) testbed node: {tp_link}; Slingshot 11 at 200 Gbit/s between nodes; A100 at "
        f"{A100_EFFECTIVE_TFLOPS:g} effective TFLOP/s (assumed)",
        "BOOST's Llama 7B at TP 4 (Megatron) and 2 stages", "reproduce/boost/llama_7b_fullrank.yaml",
        ("parallelism.pp=2", "model.tp_strategy=megatron"), A100_EFFECTIVE_TFLOPS,
        {"tp": (*tp_mbps_ms, "full"), "pp": (2e5, 0.002, "full")})
ANCHOR = "protocolnanogpt-cpu"
ANCHORS: Dict[str, Anchor] = {
    ANCHOR: MeasuredAnchor(
        "ProtocolNanoGPT: 100.5 s/step uncompressed vs 19.9 s/step compressed (taken as compute), "
        "200 Mbit/s + 50 ms per stage", "ProtocolNanoGPT's 8B-class pipeline",
        TierAnchor((100.5 - 19.9) / 19.9, 50.0 / 19.9, "full", (200.0, 50.0))),
    "resbm-80m-cpu": MeasuredAnchor(
        "ResBM Table 3: 7530 tok/s at 10 Gbps (compute-bound) vs 609 tok/s at 80 Mbps half duplex; no latency",
        "ResBM's 2B model over 8 stages", TierAnchor(7530 / 609 - 1, 0.0, "half", (80.0, 0.0))),
    # the internet tier of Heterogeneous SparseLoCo (arXiv:2601.02360): Fig. 3(b)'s 1 Gbit/s stage links, and the
    # same link between replicas (datacenter-wan-1g's 10 ms), for its 512M config; DP = a dense all-reduce per step
    "internet-1g-cpu": ModelledAnchor(
        "Heterogeneous SparseLoCo (arXiv:2601.02360) Fig. 3(b): 1 Gbit/s stage links, the same link and 10 ms "
        f"between replicas; A100 at {A100_EFFECTIVE_TFLOPS:g} effective TFLOP/s (assumed, as stage_link.py)",
        "the paper's 512M model, 8 replicas x 4 stages, 65,536 tokens per replica step",
        "reproduce/het_sparseloco/sparseloco_512m.yaml",
        ("parallelism.dp_sync=allreduce", "model.codec.kind=identity", "model.embedding.kind=standard",
         "model.output_constraint.kind=none", "sparseloco.compressed_replicas=[]"),
        A100_EFFECTIVE_TFLOPS, {"pp": (1000.0, 10.0, "full"), "dp": (1000.0, 10.0, "full")}),
    # BOOST's testbed (Perlmutter: 4 x A100 per node, NVLink 3; Slingshot 11 between nodes) for its 7B model at
    # TP 4 under Megatron; beside it the same node with PCIe 4.0 x16 between the GPUs
    "boost-nvlink-cpu": boost_node("A100 NVLink 3 at 300 GB/s per direction, ~2 us", (2.4e6, 0.002)),
    "boost-pcie-cpu": boost_node("PCIe 4.0 x16 instead of NVLink: 32 GB/s per direction, ~5 us", (2.56e5, 0.005)),
}


def tier_seconds_at_1mbps(tier: str, bytes_by_op: Mapping[str, float], dp: int, tp: int, pp: int,
                          duplex: str = "full") -> float:
    """Seconds per step one tier's traffic takes at 1 Mbit/s and no latency on the emulator's closed forms, from
    all ranks' bytes by op (the ledger's `tier:op` counts, or a closed form's). The stage link: one replica's
    one boundary, forward then backward; a collective: one rank's share of each op on its ring."""
    from nanotron_ext.parallel.link import LinkSpec, ring_collective_s

    total = sum(bytes_by_op.values())
    if tier == "pp":
        links = dp * max(pp - 1, 1)
        return (2.0 if duplex == "half" else 1.0) * total / links * 8 / 1e6
    size, world = (dp if tier == "dp" else tp), dp * tp * pp
    return sum(ring_collective_s(op, nbytes / world, size, LinkSpec(1.0, 0.0), duplex)
               for op, nbytes in bytes_by_op.items())


def modelled_setting(anchor: ModelledAnchor) -> Dict[str, Any]:
    """The real step: compute seconds per GPU and each linked tier's communication seconds (closed forms)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.config.tiers import job_bytes_per_step
    from nanotron_ext.models.param_count import count_params

    cfg = load_config(REPO / anchor.config, list(anchor.overrides))
    p, t = cfg.parallelism, cfg.tokens
    tokens = t.sequence_length * t.micro_batch_size * t.batch_accumulation_per_replica
    compute_s = 6 * count_params(cfg) * tokens / (p.pp * p.tp) / (anchor.tflops * 1e12)
    forms = job_bytes_per_step(cfg)
    comm: Dict[str, float] = {}
    for tier, (mbps, _ms, duplex) in anchor.links.items():
        if not forms.get(tier):
            raise ValueError(f"{anchor.config}: no closed-form {tier} bytes to calibrate the {tier} tier on")
        op = "send" if tier == "pp" else "all_reduce"  # the uncompressed layout: stage sends, dense all-reduces
        comm[tier] = tier_seconds_at_1mbps(tier, {op: forms[tier]}, p.dp, p.tp, p.pp, duplex) / mbps
    return {"compute_s": compute_s, "comm_s": comm, "tokens_per_replica_step": tokens}


def scaled_link(seconds_at_1mbps: float, compute_s: float, anchor: TierAnchor) -> Tuple[float, float]:
    """(bandwidth Mbit/s, latency ms) that give `anchor`'s communication / compute and latency / compute to a
    step of `compute_s` seconds whose tier traffic takes `seconds_at_1mbps` at 1 Mbit/s."""
    return (seconds_at_1mbps / (anchor.comm_over_compute * compute_s),
            anchor.latency_ms_per_compute_s * compute_s)


def tier_links(preset: str, links: Optional[Mapping[str, Tuple[float, float]]], tp_preset: str) -> list[str]:
    """The link keys of one run on a calibrated preset: each calibrated tier its scaled link (the unscaled one
    before calibration, e.g. in a dry run), DP the stage link unless calibrated itself, TP `tp_preset` unless."""
    tiers = ANCHORS[preset].tiers() if links is None else None
    keys = ["parallelism.link.enabled=true"]
    duplex = dict(_duplexes(preset))
    for tier, prefix in TIER_KEYS.items():
        source = tier if (links or tiers or {}).get(tier) is not None else ("pp" if tier == "dp" else None)
        if source is None:
            keys.append(f"parallelism.link.tp.preset={tp_preset}")
            continue
        bw, lat = links[source] if links is not None else tiers[source].unscaled  # type: ignore[index]
        keys += [f"parallelism.link.{prefix}bandwidth_mbps={bw}", f"parallelism.link.{prefix}latency_ms={lat}",
                 f"parallelism.link.{prefix}duplex={duplex[source]}"]
    return keys


def _duplexes(preset: str) -> Dict[str, str]:
    a = ANCHORS[preset]
    if isinstance(a, MeasuredAnchor):
        return {"pp": a.pp.duplex}
    return {tier: duplex for tier, (_, _, duplex) in a.links.items()}


def describe(preset: str) -> str:
    """One line per calibrated preset: its source, what it stands for and each tier's ratio."""
    a = ANCHORS[preset]
    ratios = ", ".join(f"{tier} comm/compute {ta.comm_over_compute:.3g}" for tier, ta in a.tiers().items())
    return f"{preset}: {a.stands_for}; {a.source}; {ratios}"
