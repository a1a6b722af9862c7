"""Emulated pipeline links: bandwidth and latency on any backend.

A link (one direction between two pipeline stages) serialises its messages: a message starts
when both it is sent and the previous one on the link has left, takes nbytes * 8 / bandwidth
seconds to leave, and arrives `latency` later. The sender never blocks (computation overlaps
transmission); the receiver waits until the arrival time before it may use the tensor.

The sender computes the arrival time and sends it ahead of the data as one float64 (recorded
under op "send:link-clock"). All ranks run on one host in emulation, so wall-clock time is
shared and comparable across processes.

Duplex: "full" gives each direction its own link (above). "half" makes both directions between
two stages share ONE bandwidth budget (a message waits for traffic in either direction), which is
how the ResBM paper's Table 3 link behaves (80 Mbit/s carrying activations and gradients: 609 TPS =
80e6 / (2 x 4096 x 16 bit)). The two directions are sent by different processes, so their shared
"free at" clock lives in a small file under the temp dir, keyed by the run (torchrun's run id or the
rendezvous port) and the stage pair, read and advanced under an exclusive file lock.
"""
from __future__ import annotations

import dataclasses
import fcntl
import math
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Dict, Mapping, Optional, Protocol, Tuple


class LinkSettings(Protocol):
    """What the emulator reads from `parallelism.link` (parallel/ does not import config/)."""

    enabled: bool
    bandwidth_mbps: float
    latency_ms: float
    per_stage_pair: Mapping[str, Mapping[str, float]]
    duplex: str


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One link's bandwidth (Mbit/s; 0 = unlimited) and one-way latency (ms)."""

    bandwidth_mbps: float = 0.0
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects NaN, which would otherwise make every arrival time NaN and
        # silently switch the delay off (NaN > 0 is False in wait_until); inf latency never arrives
        # and inf bandwidth is spelled 0.
        for name in ("bandwidth_mbps", "latency_ms"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"link {name} must be finite and >= 0 (bandwidth 0 = unlimited), got {self}")

    @property
    def is_ideal(self) -> bool:
        """Unlimited bandwidth and no latency: nothing to emulate."""
        return self.bandwidth_mbps == 0 and self.latency_ms == 0

    def transmit_s(self, nbytes: int) -> float:
        """Seconds `nbytes` occupy the link (serialisation time, latency excluded)."""
        return 0.0 if self.bandwidth_mbps == 0 else nbytes * 8 / (self.bandwidth_mbps * 1e6)


class SharedClock:
    """A float ("the link is free at") shared by the processes of one run through a locked file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def reserve(self, now: float, seconds: float) -> float:
        """Occupy the link for `seconds` from max(now, free at); returns when the message has left."""
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            data = f.read()
            free = struct.unpack("d", data)[0] if len(data) == 8 else 0.0
            leaves = max(now, free) + seconds
            f.seek(0)
            f.truncate()
            f.write(struct.pack("d", leaves))
        return leaves


def run_key() -> str:
    """Names this run's shared link clocks: torchrun's run id, else the rendezvous address."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return f"run-{rid}"
    return f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', str(os.getpid()))}"


class LinkEmulator:
    """Link state between pipeline stages (pp ranks): per direction, or one shared budget per pair."""

    def __init__(self, default: LinkSpec, per_pair: Optional[Dict[Tuple[int, int], LinkSpec]] = None,
                 duplex: str = "full", shared_dir: Optional[Path] = None) -> None:
        if duplex not in ("full", "half"):
            raise ValueError(f"parallelism.link.duplex must be 'full' or 'half', got {duplex!r}")
        self.default = default
        self.per_pair = dict(per_pair or {})
        self.duplex = duplex
        self.shared_dir = shared_dir
        self._free_at: Dict[Tuple[int, int], float] = {}
        self._clocks: Dict[Tuple[int, int], SharedClock] = {}

    def _key(self, src: int, dst: int) -> Tuple[int, int]:
        return (src, dst) if self.duplex == "full" else (min(src, dst), max(src, dst))

    def spec(self, src: int, dst: int) -> LinkSpec:
        """The link src -> dst; a pair given as (a, b) covers both directions."""
        return self.per_pair.get((src, dst)) or self.per_pair.get((dst, src)) or self.default

    def delays(self, src: int, dst: int) -> bool:
        """Whether messages src -> dst are delayed at all (both ends agree: same config)."""
        return not self.spec(src, dst).is_ideal

    def schedule_send(self, src: int, dst: int, nbytes: int, now: Optional[float] = None) -> float:
        """Reserve the link for `nbytes` sent now; returns the wall-clock arrival time."""
        now = time.time() if now is None else now
        spec, key = self.spec(src, dst), self._key(src, dst)
        if self.duplex == "half" and self.shared_dir is not None:  # the other direction is another process
            clock = self._clocks.get(key) or self._clocks.setdefault(
                key, SharedClock(self.shared_dir / f"link-{key[0]}-{key[1]}.clock"))
            leaves = clock.reserve(now, spec.transmit_s(nbytes))
        else:
            leaves = max(now, self._free_at.get(key, 0.0)) + spec.transmit_s(nbytes)
            self._free_at[key] = leaves
        return leaves + spec.latency_ms / 1e3

    @staticmethod
    def wait_until(arrival: float) -> None:
        """Sleep until wall-clock time `arrival` (no-op if it has passed)."""
        delay = arrival - time.time()
        if delay > 0:
            time.sleep(delay)


def link_emulator_from_config(cfg: LinkSettings) -> Optional[LinkEmulator]:
    """The emulator for `parallelism.link`, or None when it is disabled.

    A per-stage-pair entry ("0-1": {...}) covers both directions unless the reverse pair ("1-0")
    is given too (then each covers its own direction, as in LinkEmulator.spec); keys an entry
    leaves out take the section's default, so {"0-1": {"latency_ms": 5}} keeps the default bandwidth.
    """
    if not cfg.enabled:
        return None
    default = LinkSpec(bandwidth_mbps=float(cfg.bandwidth_mbps), latency_ms=float(cfg.latency_ms))
    per_pair: Dict[Tuple[int, int], LinkSpec] = {}
    for key, override in cfg.per_stage_pair.items():
        a, b = (int(part) for part in key.split("-"))
        if a == b:
            raise ValueError(f"parallelism.link.per_stage_pair.{key}: a stage has no link to itself")
        try:
            per_pair[(a, b)] = dataclasses.replace(default, **{k: float(v) for k, v in override.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"parallelism.link.per_stage_pair.{key}: {e}") from e
    duplex = getattr(cfg, "duplex", "full")
    shared = Path(tempfile.gettempdir()) / "nanotron_ext_links" / run_key() if duplex == "half" else None
    return LinkEmulator(default, per_pair, duplex=duplex, shared_dir=shared)
