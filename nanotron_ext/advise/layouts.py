"""Which layouts each system may take on a hardware, and where its ranks sit.

A layout counts only where a loss run has its math:
- a per-step all-reduce system computes the same function at every dp x tp x pp with the same global batch (TP and
  pipelining are exact re-shardings: tests/test_parallel_parity.py), so any layout counts;
- a codec system's math is its compressed boundaries: the loss runs put one at the middle of the model (pp = 2), so
  pp = 2 only;
- an outer-loop system's math is its replica count M and inner steps H: the loss runs have M = 2, so dp = 2 only;
  the heterogeneous ones also fix which replica is compressed (replica 0, placed over the internet).
TP divides a node (a TP group never leaves its node); a node holds gpus_per_node / tp slots, each one stage of one
replica, filled replica by replica (a pipeline stays inside a node where it fits), the datacenter's nodes first:
any subset of the hardware's nodes, one node included (DiLoCo's two replicas on one 2-GPU node); pp a power of two
dividing the layers (`PIPELINE_DEPTHS`: one plan per tp and depth). Micro-batches: the loss runs'
global batch split into micro-batches of the scale config's size, or 1/2 or 1/4 of it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from nanotron_ext.advise.hardware import Hardware


@dataclasses.dataclass(frozen=True)
class Rule:
    """A system's layouts that have its loss runs' math: fixed dp / pp (None: any), the replica it compresses."""

    label: str
    dp: Optional[int] = None
    pp: Optional[int] = None
    compressed_replica: Optional[int] = None  # a heterogeneous system: this replica's pipeline is compressed
    outer_loop: bool = False
    plan_as: Optional[str] = None  # a system whose step is another's (DiLoCo's Nesterov: elementwise outer math)
    bf16_gradients: bool = False  # the DP all-reduce in bf16 (the plan's fp32 payload halved)
    steps_as: Optional[str] = None  # a system whose loss runs are another's (bf16 gradient reduction: not loss-run)
    # a streaming outer sync's delay tau (sparseloco.streaming.delay) set on plan_as's plan: its payload is the
    # blocking sync's byte for byte (nanotron_ext/sparseloco/streaming.py), only when it is waited for differs
    outer_overlap: int = 0


# the WAN meter's systems (nanotron_ext/bench/wan/systems.py) advise compares; the dense baseline twice, once with
# bf16 gradient reduction (what its best user would pick where the DP link binds)
RULES: Dict[str, Rule] = {
    "dense_3d": Rule("dense (Megatron TP, all-reduce every step, fp32 gradients)"),
    "dense_3d@bf16": Rule("dense (Megatron TP, all-reduce every step, bf16 gradients)", plan_as="dense_3d",
                          bf16_gradients=True, steps_as="dense_3d"),
    "3d_btp": Rule("BOOST BTP (SVD r = d/4), all-reduce every step"),
    "3d_sm": Rule("SM k = d/8 on the stage link, all-reduce every step", pp=2),
    "3d_int4": Rule("lossy int4 on the stage link, all-reduce every step", pp=2),
    "3d_mapl": Rule("MAPL on the stage link, all-reduce every step", pp=2),
    "3d_diloco": Rule("dense DiLoCo, plain averaging (outer SGD lr 1, no momentum)", dp=2, outer_loop=True),
    "3d_diloco_nesterov": Rule("dense DiLoCo, outer Nesterov (lr 0.7, momentum 0.9)", dp=2, outer_loop=True,
                               plan_as="3d_diloco"),
    "3d_sparseloco": Rule("SparseLoCo (top-k outer sync)", dp=2, outer_loop=True),
    "3d_btp_sparseloco": Rule("BTP + SparseLoCo", dp=2, outer_loop=True),
    # the streaming outer sync (arXiv:2501.18512, tau = 1 inner step, alpha 0.5): loss runs of their own
    "3d_diloco_nesterov_streaming": Rule("dense DiLoCo, outer Nesterov, streaming outer sync (tau = 1)", dp=2,
                                         outer_loop=True, plan_as="3d_diloco", outer_overlap=1),
    "3d_btp_sparseloco_streaming": Rule("BTP + SparseLoCo, streaming outer sync (tau = 1)", dp=2, outer_loop=True,
                                        plan_as="3d_btp_sparseloco", outer_overlap=1),
    "3d_sm_sparseloco": Rule("heterogeneous SparseLoCo (SM on replica 0)", dp=2, pp=2, compressed_replica=0,
                             outer_loop=True),
    "three_tiers": Rule("three tiers: BTP + SM on replica 0 + heterogeneous SparseLoCo", dp=2, pp=2,
                        compressed_replica=0, outer_loop=True),
    "three_tiers_streaming": Rule("three tiers, streaming outer sync (tau = 1)", dp=2, pp=2, compressed_replica=0,
                                  outer_loop=True, plan_as="three_tiers", outer_overlap=1),
}
PIPELINE_DEPTHS = (1, 2, 4, 8)  # pp searched: powers of two that divide the layers (a plan per depth)
# the composed jobs the headline is about
COMPOSED = ("three_tiers", "3d_sm_sparseloco", "3d_btp_sparseloco", "3d_btp_sparseloco_streaming",
            "three_tiers_streaming")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One placement: dp x tp x pp, the micro-batch size and count, each replica's nodes (stage s on nodes[r][s])."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    micro_batches: int
    nodes: Tuple[Tuple[int, ...], ...]

    @property
    def used_nodes(self) -> int:
        return len({n for r in self.nodes for n in r})

    @property
    def busiest_node_slots(self) -> int:
        """Stages on the most crowded node: their DP rings share its uplink (the clock counts one TP group's)."""
        counts: Dict[int, int] = {}
        for r in self.nodes:
            for n in r:
                counts[n] = counts.get(n, 0) + 1
        return max(counts.values())

    def describe(self, hw: Hardware) -> str:
        dc = len({n for r in self.nodes for n in r if n < hw.datacenter_nodes})
        where = ("datacenter only" if dc == self.used_nodes else "internet only" if dc == 0
                 else f"{dc} of {self.used_nodes} nodes in the datacenter")
        return (f"dp {self.dp} x tp {self.tp} x pp {self.pp}, {self.micro_batches} x {self.micro_batch_size} "
                f"sequences per replica, {self.used_nodes} of {hw.nodes} nodes ({where})")


def place(hw: Hardware, dp: int, pp: int, compressed: Optional[int], tp: Optional[int] = None
          ) -> Tuple[Tuple[int, ...], ...]:
    """Each replica's node per stage: slots (gpus_per_node / tp per node) filled replica by replica, the datacenter's
    nodes first, the uncompressed replicas first (a compressed replica is the one built to cross the internet)."""
    per_node = hw.gpus_per_node // (tp or hw.gpus_per_node)
    order = sorted(range(dp), key=lambda r: r == compressed)
    out: Dict[int, Tuple[int, ...]] = {}
    for i, r in enumerate(order):
        out[r] = tuple((i * pp + s) // per_node for s in range(pp))
    return tuple(out[r] for r in range(dp))


def layouts(hw: Hardware, rule: Rule, global_sequences: int, micro_batch_size: int, num_layers: int) -> List[Layout]:
    """Every layout of `rule` on `hw` for a step of `global_sequences` sequences."""
    out = []
    dps = [rule.dp] if rule.dp else range(1, hw.nodes * hw.gpus_per_node + 1)
    pps = [rule.pp] if rule.pp else [p for p in PIPELINE_DEPTHS if num_layers % p == 0]
    sizes = sorted({max(1, micro_batch_size // f) for f in (1, 2, 4)}, reverse=True)
    for tp in [t for t in range(hw.gpus_per_node, 0, -1) if hw.gpus_per_node % t == 0]:
        slots = hw.nodes * (hw.gpus_per_node // tp)
        for dp in dps:
            for pp in pps:
                if dp * pp > slots or global_sequences % dp:
                    continue
                per_replica = global_sequences // dp
                for mbs in sizes:
                    if per_replica % mbs == 0:
                        out.append(Layout(dp, tp, pp, mbs, per_replica // mbs,
                                          place(hw, dp, pp, rule.compressed_replica, tp)))
    return out


def stage_links(hw: Hardware, layout: Layout) -> List[Tuple[float, float]]:
    """Each replica's link between its stages (its nodes' span)."""
    return [hw.span_link(nodes) for nodes in layout.nodes]


def dp_link(hw: Hardware, layout: Layout) -> Tuple[float, float]:
    """The DP tier's link: the span of every used node (one uplink per node)."""
    return hw.span_link(tuple(n for nodes in layout.nodes for n in nodes))
