"""The hardware `advise` searches layouts on: nodes of GPUs, which nodes share a datacenter, and three links.

A node holds `gpus_per_node` GPUs on its own fast link (NVLink); the first `datacenter_nodes` nodes also share a
datacenter network (InfiniBand); every other pair of nodes talks over the internet, one uplink per node. A group of
ranks talks over the slowest link among the nodes it spans. A preset of the model clock
(nanotron_ext/bench/clock/hardware.py: `internet-1g`, `protocolnanogpt-200m-50ms`) is read as the hardware its
placement describes: one node per stage (a node is one TP group), the datacenter replica's nodes in the datacenter.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Dict, Tuple

from nanotron_ext.bench.clock import CLOCK_PRESETS, ClockPreset, Link
from nanotron_ext.errors import UserFacingError

Mbps_ms = Tuple[float, ...]  # (Mbit/s, one-way ms[, ms per collective call]): the model clock's link tuple


def clock_link(link: Mbps_ms, duplex: str = "full", holds_wire: bool = False) -> Link:
    """A hardware link as the model clock's `Link` (a third number: a collective call's fixed cost)."""
    extra = {"call_ms": link[2]} if len(link) > 2 else {}
    return Link(link[0], link[1], duplex, holds_wire, **extra)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Nodes, devices and links. Links are (Mbit/s one direction, one-way ms); 0 Mbit/s is never allowed here."""

    name: str
    source: str
    nodes: int
    gpus_per_node: int
    device_gib: float
    tflops: float  # effective TFLOP/s per GPU
    datacenter_nodes: int  # nodes 0 .. datacenter_nodes - 1 share the datacenter link
    node_link: Mbps_ms
    datacenter_link: Mbps_ms
    internet_link: Mbps_ms
    duplex: str = "full"
    latency_holds_wire: bool = False  # the internet stage links' latency keeps the wire busy (clock.Link)

    def __post_init__(self) -> None:
        where = f"hardware {self.name!r}"
        for key in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise UserFacingError(f"{where}: {key} must be a whole number >= 1, got {getattr(self, key)!r}")
        if not 0 <= self.datacenter_nodes <= self.nodes:
            raise UserFacingError(f"{where}: datacenter_nodes must be in [0, nodes = {self.nodes}], "
                                  f"got {self.datacenter_nodes!r}")
        for key in ("device_gib", "tflops"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UserFacingError(f"{where}: {key} must be a finite number > 0, got {v!r}")
        for key in ("node_link", "datacenter_link", "internet_link"):
            link = getattr(self, key)
            if (len(link) not in (2, 3) or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in link)
                    or link[0] <= 0 or min(link[1:]) < 0):
                raise UserFacingError(f"{where}: {key} must be [Mbit/s > 0, one-way ms >= 0(, ms per collective "
                                      f"call >= 0)], got {list(link)!r}")
        if self.duplex not in ("full", "half"):
            raise UserFacingError(f"{where}: duplex must be full or half, got {self.duplex!r}")

    def span_link(self, nodes: Tuple[int, ...]) -> Mbps_ms:
        """The link a group spanning these nodes talks over: within one node, the datacenter, or the internet."""
        if len(set(nodes)) <= 1:
            return self.node_link
        if all(n < self.datacenter_nodes for n in nodes):
            return self.datacenter_link
        return self.internet_link


def from_clock_preset(name: str, preset: ClockPreset, device_gib: float = 80.0) -> Hardware:
    """A model-clock preset read as hardware: the meter's 3D layout (dp x pp nodes of tp GPUs), its datacenter
    replicas' nodes in the datacenter (A100-80GB: the presets' device)."""
    dp, pp, tp = 2, 2, 2  # the layout every like-for-like row of the committed model clock uses
    dc = sum(pp for r in range(dp) if r in preset.datacenter_replicas)
    return Hardware(name, preset.source, dp * pp, tp, device_gib, preset.tflops, dc, preset.tp,
                    preset.datacenter_stage, preset.stage, preset.duplex, preset.latency_holds_wire)


def presets() -> Dict[str, Hardware]:
    """The model clock's presets as hardware, by name."""
    return {name: from_clock_preset(name, p) for name, p in CLOCK_PRESETS.items()}


def load(path: Path) -> Hardware:
    """A hardware YAML: every field of `Hardware` (links as [Mbit/s, ms]); unknown or missing keys refused by name."""
    from nanotron_ext.config.yaml_io import read_yaml

    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise UserFacingError(f"{path}: a hardware file is a mapping of keys, got {type(raw).__name__}")
    raw = dict(raw)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    required = {f.name for f in dataclasses.fields(Hardware) if f.default is dataclasses.MISSING} - {"name", "source"}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise UserFacingError(f"{path}: unknown key {unknown[0]!r}; the keys: {', '.join(sorted(fields))}")
    missing = sorted(required - set(raw))
    if missing:
        raise UserFacingError(f"{path}: missing key {missing[0]!r}")
    raw.setdefault("name", path.stem)
    raw.setdefault("source", str(path))
    for key in ("node_link", "datacenter_link", "internet_link"):
        v = raw[key]
        if not isinstance(v, (list, tuple)):
            raise UserFacingError(f"{path}: {key} must be [Mbit/s, one-way ms], got {v!r}")
        raw[key] = tuple(v)
    return Hardware(**raw)
