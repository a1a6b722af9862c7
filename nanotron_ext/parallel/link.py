"""Emulated pipeline links: bandwidth and latency on any backend.

A link (one direction between two pipeline stages) serialises its messages: a message starts
when both it is sent and the previous one on the link has left, takes nbytes * 8 / bandwidth
seconds to leave, and arrives `latency` later. The sender never blocks (computation overlaps
transmission); the receiver waits until the arrival time before it may use the tensor.

The sender computes the arrival time and sends it ahead of the data as one float64 (recorded
under op "send:link-clock"). All ranks run on one host in emulation, so wall-clock time is
shared and comparable across processes.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One link's bandwidth (Mbit/s; 0 = unlimited) and one-way latency (ms)."""

    bandwidth_mbps: float = 0.0
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_mbps < 0 or self.latency_ms < 0:
            raise ValueError(f"link bandwidth_mbps and latency_ms must be >= 0, got {self}")

    def transmit_s(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth_mbps == 0 else nbytes * 8 / (self.bandwidth_mbps * 1e6)


class LinkEmulator:
    """Per-direction link state between pipeline stages (pp ranks)."""

    def __init__(self, default: LinkSpec, per_pair: Optional[Dict[Tuple[int, int], LinkSpec]] = None) -> None:
        self.default = default
        self.per_pair = dict(per_pair or {})
        self._free_at: Dict[Tuple[int, int], float] = {}

    def spec(self, src: int, dst: int) -> LinkSpec:
        """The link src -> dst; a pair given as (a, b) covers both directions."""
        return self.per_pair.get((src, dst)) or self.per_pair.get((dst, src)) or self.default

    def schedule_send(self, src: int, dst: int, nbytes: int, now: Optional[float] = None) -> float:
        """Reserve the link for `nbytes` sent now; returns the wall-clock arrival time."""
        now = time.time() if now is None else now
        spec = self.spec(src, dst)
        start = max(now, self._free_at.get((src, dst), 0.0))
        leaves = start + spec.transmit_s(nbytes)
        self._free_at[(src, dst)] = leaves
        return leaves + spec.latency_ms / 1e3

    @staticmethod
    def wait_until(arrival: float) -> None:
        delay = arrival - time.time()
        if delay > 0:
            time.sleep(delay)
