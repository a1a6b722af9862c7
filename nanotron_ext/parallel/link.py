"""Emulated links per tier (pipeline stage pairs, the TP group, the DP / outer-sync group) on any backend.

Pipeline tier (point-to-point, `LinkEmulator`, used by parallel/p2p.py):

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

TP and DP tiers (collectives, `CollectiveLinks`): patch 0007 reports every collective made through
nanotron.distributed to hooks before it is issued; the hook installed here sleeps, on every rank of the
group, the time the collective would take on a ring of p ranks joined by links of bandwidth B bit/s
and one-way latency a seconds, then lets the real collective run (and the ledger count its bytes). The
real collective finishes when its last rank arrives, so the group finishes together at
max(arrival) + T, as a ring would. With N = the bytes handed to the call on this rank (the ledger's
count) and b = 8 / B seconds per byte, the standard ring costs (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 2005, section 4) are:

    all_reduce      reduce-scatter then all-gather, 2(p-1) steps of N/p bytes each:
                    T = 2 (p-1)/p * N * b + 2 (p-1) * a
    reduce_scatter  (N = the whole input) p-1 steps of N/p:     T = (p-1)/p * N * b + (p-1) * a
    all_gather      (N = the local shard)  p-1 steps of N:      T = (p-1) * N * b + (p-1) * a
                    (= (p-1)/p * pN * b: the same ring factor on the gathered size)
    broadcast       pipelined chain, many segments (the limit): T = N * b + (p-1) * a

Every step of a ring sends on one link and receives on another at the same time; with duplex "half"
a rank's send and receive share one budget, so the bandwidth term doubles (latency does not).
Point-to-point calls on TP/DP groups and collectives on the pp / world / mp groups (the loss broadcast,
gradient-norm and agreement reductions: a few bytes of control traffic) are not delayed. Asynchronous
collectives are waited for at issue (overlap with compute is not modelled: an upper bound on their cost).

Waits are accumulated per tier (`waited_seconds`) so the trainer can log the fraction of each step spent
waiting on each tier: for the pipeline, the receiver's sleep until a message arrives (time the link
adds beyond the sender's compute); for collectives, the sleep above.

Presets (`LINK_PRESETS`) name common links; each entry says where its numbers come from.
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
from typing import Callable, Dict, Mapping, Optional, Protocol, Tuple


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
        """Sleep until wall-clock time `arrival` (no-op if it has passed); counted as the pipeline tier's wait."""
        delay = arrival - time.time()
        if delay > 0:
            time.sleep(delay)
            _WAITED["pp"] = _WAITED.get("pp", 0.0) + delay


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


# -- presets ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LinkPreset:
    """A named link: bandwidth (Mbit/s, one direction), one-way latency (ms), duplex, and where the numbers come
    from."""

    bandwidth_mbps: float
    latency_ms: float
    duplex: str
    source: str

    @property
    def spec(self) -> LinkSpec:
        return LinkSpec(self.bandwidth_mbps, self.latency_ms)


LINK_PRESETS: Dict[str, LinkPreset] = {
    "nvlink": LinkPreset(3.6e6, 0.002, "full",
                         "NVIDIA H100 SXM datasheet: NVLink 4 at 900 GB/s bidirectional = 450 GB/s = 3.6 Tbit/s per "
                         "direction; ~2 us one NVSwitch hop (order of magnitude, our assumption)"),
    "infiniband": LinkPreset(4e5, 0.002, "full",
                             "NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gbit/s per port; ~2 us end to end "
                             "(order of magnitude, our assumption). ResBM's introduction quotes ~300 Gb/s"),
    "nvlink3": LinkPreset(2.4e6, 0.002, "full",
                          "NVIDIA A100 datasheet: NVLink 3 at 600 GB/s bidirectional = 300 GB/s = 2.4 Tbit/s per "
                          "direction (BOOST's Perlmutter nodes); ~2 us one hop (order of magnitude, our assumption)"),
    "slingshot11": LinkPreset(2e5, 0.002, "full",
                              "HPE Slingshot 11 (NERSC Perlmutter, BOOST's testbed between nodes): 200 Gbit/s per NIC; "
                              "~2 us (order of magnitude, our assumption)"),
    "10gbe": LinkPreset(1e4, 0.05, "full",
                        "IEEE 802.3ae 10 Gbit/s Ethernet, ResBM Table 3's centralised baseline (10 Gbps); 50 us one "
                        "way is a typical same-rack TCP latency (our assumption)"),
    "datacenter-wan-1g": LinkPreset(1e3, 10.0, "full",
                                    "1 Gbit/s between sites: heterogeneous SparseLoCo's Fig. 3(b) "
                                    "stage links and ResBM's 'consumer internet ... around 1 Gb/s'; 10 ms one way for "
                                    "regions on one continent (our assumption)"),
    "internet-200m-50ms": LinkPreset(200.0, 50.0, "full",
                                     "Pluralis' ProtocolNanoGPT: 200 Mbit/s and 50 ms per pipeline stage (100.5 s/step "
                                     "uncompressed vs 19.9 s/step with subspace compression, 5.05x)"),
    "internet-80m": LinkPreset(80.0, 0.0, "half",
                               "ResBM Table 3's decentralised link: 80 Mbit/s carrying activations "
                               "and gradients in one budget (609 tok/s = 80e6 / (2 x 4096 x 16 bit): half duplex, "
                               "latency not in the number)"),
}


# -- collective cost model of the datacenter tiers (the model clock's TP / DP tiers and stage hops) ----------------

@dataclasses.dataclass(frozen=True)
class CollectiveModel:
    """NCCL's own cost model of a ring collective (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel, Ring/Simple):
    T = base + steps x step latency + volume / bus bandwidth, with steps = 2(p-1) for all-reduce and p-1 for
    reduce-scatter / all-gather, and volume / bus bandwidth the nccl-tests busbw definition (doc/PERFORMANCE.md:
    busbw = algbw x 2(p-1)/p for all-reduce, x (p-1)/p for reduce-scatter and all-gather), i.e. the ring forms of
    `ring_collective_s` at the bus bandwidth. Message size matters through the fixed terms: a small call pays
    base + steps x step latency whatever its bytes."""

    bus_gbytes_s: float  # GB/s per direction a ring moves (nccl-tests' busbw)
    base_us: float  # per call (NCCL baseLat, Ring/Simple)
    step_us: float  # per ring step (NCCL hwLat of the hardware, Ring/Simple)
    source: str

    @property
    def bus_mbps(self) -> float:
        return self.bus_gbytes_s * 8e3

    @property
    def step_ms(self) -> float:
        return self.step_us / 1e3

    @property
    def base_ms(self) -> float:
        return self.base_us / 1e3


_NCCL = ("NCCL src/graph/tuning.cc (v2.19-2.23): Ring/Simple baseLat 8.4 us per call, hwLat {} us per step; "
         "src/graph/topo.h: {}")
COLLECTIVE_MODELS: Dict[str, CollectiveModel] = {
    "nvlink3": CollectiveModel(240.0, 8.4, 3.4, _NCCL.format(
        "NVLink 3.4", "SM80_NVLINK_BW = 20 GB/s per NVLink 3 link as NCCL's ring search counts it, x the A100's 12 "
        "links = 240 GB/s bus bandwidth when the rings use every link (below the datasheet's 300 GB/s = 12 x 25)")),
    "nvlink": CollectiveModel(370.8, 8.4, 3.4, _NCCL.format(
        "NVLink 3.4", "SM90_NVLINK_BW = 20.6 GB/s per NVLink 4 link x the H100 SXM's 18 links = 370.8 GB/s")),
    "infiniband": CollectiveModel(50.0, 8.4, 14.0, _NCCL.format(
        "NET 14.0", "a NIC at its line rate: ConnectX-7 NDR 400 Gbit/s = 50 GB/s")),
    "slingshot11": CollectiveModel(25.0, 8.4, 14.0, _NCCL.format(
        "NET 14.0", "a NIC at its line rate: HPE Slingshot 11, 200 Gbit/s = 25 GB/s per NIC (Perlmutter)")),
}
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def collective_s(op: str, nbytes: float, group_size: int, model: CollectiveModel) -> float:
    """Seconds of one collective call `op` of `nbytes` (this rank's payload, as the ledger counts it) on a ring of
    `group_size` ranks under `model`: the call's base, each ring step's latency, and the ring's volume at the bus
    bandwidth (CollectiveModel); 0 for a group of one or an op that is not a ring collective."""
    if group_size <= 1 or op.split(":")[0] not in RING_OPS:
        return 0.0
    return model.base_ms / 1e3 + ring_collective_s(op, nbytes, group_size,  # type: ignore[arg-type]
                                                    LinkSpec(model.bus_mbps, model.step_ms))


def link_preset(name: str) -> LinkPreset:
    """The preset `name`; ValueError listing the known ones otherwise."""
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown link preset {name!r}; known: {', '.join(LINK_PRESETS)}") from None


# -- collectives (TP and DP tiers) -----------------------------------------------------------------

COLLECTIVE_TIERS = ("tp", "dp")  # the ledger's names of the groups whose collectives a tier delays


def ring_collective_s(op: str, nbytes: int, group_size: int, spec: LinkSpec, duplex: str = "full") -> float:
    """Seconds a collective `op` of `nbytes` (this rank's payload, as the ledger counts it) takes on a ring of
    `group_size` ranks over links `spec` (the closed forms of the module docstring); 0 for other ops."""
    p = group_size
    if p <= 1:
        return 0.0
    base = op.split(":")[0]
    steps, volume = {
        "all_reduce": (2 * (p - 1), 2 * (p - 1) / p * nbytes),
        "reduce_scatter": (p - 1, (p - 1) / p * nbytes),
        "all_gather": (p - 1, (p - 1) * nbytes),
        "broadcast": (p - 1, float(nbytes)),
    }.get(base, (0, 0.0))
    if steps == 0:
        return 0.0
    serialise = volume * 8 / (spec.bandwidth_mbps * 1e6) if spec.bandwidth_mbps else 0.0
    return (2.0 if duplex == "half" else 1.0) * serialise + steps * spec.latency_ms / 1e3


class CollectiveLinks:
    """The TP / DP tiers: a comm hook that sleeps each collective's ring time before it is issued."""

    def __init__(self, tiers: Mapping[str, Tuple[LinkSpec, str]], group_name: Callable[[object], str]) -> None:
        self.tiers = {t: v for t, v in tiers.items() if not v[0].is_ideal}
        self.group_name = group_name

    def wait_s(self, op: str, nbytes: int, group: object) -> Tuple[Optional[str], float]:
        """(tier, seconds) this collective waits; (None, 0) when no tier delays it."""
        if group is None or op.startswith(("send", "recv")):
            return None, 0.0
        tier = self.group_name(group)
        if tier not in self.tiers:
            return None, 0.0
        spec, duplex = self.tiers[tier]
        return tier, ring_collective_s(op, nbytes, group.size(), spec, duplex)  # type: ignore[attr-defined]

    def __call__(self, op: str, nbytes: int, group: object, peer: Optional[int] = None) -> None:
        tier, seconds = self.wait_s(op, nbytes, group)
        if seconds > 0:
            time.sleep(seconds)
            _WAITED[tier] = _WAITED.get(tier, 0.0) + seconds


_WAITED: Dict[str, float] = {}  # seconds this process has waited on each tier's emulated links
_INSTALLED: Dict[str, Callable[[], None]] = {}


def waited_seconds() -> Dict[str, float]:
    """Seconds waited on each tier's emulated links so far in this process (a copy)."""
    return dict(_WAITED)


def install_collective_links(cfg: "TierLinkSettings", group_name: Callable[[object], str]) -> Optional[CollectiveLinks]:
    """Hook the TP / DP tiers of `parallelism.link` into nanotron.distributed (replacing an earlier install);
    None when the section is disabled or neither tier is limited."""
    import nanotron.distributed as dist  # here: link.py stays importable without torch (the config loader)

    remove = _INSTALLED.pop("collectives", None)
    if remove is not None:
        remove()
    if not cfg.enabled:
        return None
    tiers = {t: (LinkSpec(float(getattr(cfg, t).bandwidth_mbps), float(getattr(cfg, t).latency_ms)),
                 getattr(cfg, t).duplex) for t in COLLECTIVE_TIERS}
    links = CollectiveLinks(tiers, group_name)
    if not links.tiers:
        return None
    _INSTALLED["collectives"] = dist.register_comm_hook(links)
    return links


class TierLinkSettings(Protocol):
    """What install_collective_links reads: `enabled` and one settings object per collective tier."""

    enabled: bool
    tp: object
    dp: object
