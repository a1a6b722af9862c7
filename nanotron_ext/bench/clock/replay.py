"""The model clock: a system's step time on a preset's hardware, replayed from its schedule (`--clock model`).

The DiLoCo line of work and heterogeneous SparseLoCo take learning from real runs and time from a stated model;
this is that model. A step is replayed, not measured:

- compute: each stage's forward and backward of one micro-batch, in seconds (FLOPs / the device's effective
  throughput, `profile.py`), with the stage's TP collectives on the critical path (a Megatron or BTP layer waits for
  its all-reduce: no bound overlaps them);
- the pipeline schedule: AFAB (GPipe: every forward, then every backward, micro-batches in order) or 1F1B
  (PipeDream-flush: pp - s - 1 warm-up forwards on stage s, then one forward one backward, then the remaining
  backwards), the bubbles falling out of the dependencies: F(s, i) needs F(s-1, i)'s activation to have arrived,
  B(s, i) needs B(s+1, i)'s gradient;
- each stage pair's link in each direction a FIFO of messages: a message starts when it is ready and the link is
  free, leaves `bytes * 8 / bandwidth` later and arrives one latency after that; "half" duplex makes both directions
  one link (ResBM's 80 Mbit/s); `latency_holds_wire` keeps the wire busy for the latency too (a meter that starts
  the next message only after the last one arrived: ProtocolNanoGPT's). One link per node: a stage's TP ranks share
  their node's uplink, so a message is every TP rank's share of the wire together; a shaped link's token bucket
  (`burst_bytes`, tc tbf's) lets a message through at line rate while the bucket holds it (the real-network check of
  bench/multi_host.py: a 64 KiB bucket carries a subspace boundary's whole step);
- the DP tier once per step (a per-step all-reduce) or the outer sync once per H steps, each stage's node over its
  own uplink (the ring forms of parallel/link.py, with a node's TP ranks' rings sharing that uplink).

Two bounds, since real systems overlap communication with compute to different degrees:

- `upper` (no overlap): a sender waits until its message has arrived (a synchronous send: nanotron's blocking
  point-to-point over gloo, which returns once the peer took the data); the DP all-reduce starts after the
  pipeline flush; the outer sync stops every replica until it is done; the step's few-byte agreements over the DP
  tier (the trainer averages the logged loss over the replicas every step, also between outer syncs) each pay
  their ring's latency.
- `lower` (full overlap): a sender goes on computing while its message is on the wire (what the real-sleep
  emulator does); each stage's DP all-reduce starts when its last backward starts (DDP's buckets: earlier
  micro-batches' gradients are not final before that) and the step ends when both the pipeline and every
  all-reduce have; the outer sync runs behind the next H inner steps, or behind the tau inner steps a streaming
  sync gives it before its result is applied (Streaming DiLoCo's delay: a cycle then takes H steps plus whatever of
  the sync tau steps did not hide); agreements that carry no tensor the next step needs are off the critical path.

Replicas run in lock step (the DP all-reduce) or H steps apart (the outer loop): either way the slowest replica
paces the job. Everything here is plain arithmetic on numbers; tests/test_wan_clock.py holds it to closed forms.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Link:
    """One link: bandwidth in Mbit/s (0: unlimited), one-way latency in ms, duplex "full" or "half", and whether a
    message's latency keeps the wire busy (the next message starts after it arrived) or is pipelined."""

    mbps: float
    latency_ms: float = 0.0
    duplex: str = "full"
    latency_holds_wire: bool = False
    # a shaper's token bucket (tc tbf): after an idle spell this many bytes leave at line rate, then the rate holds.
    # The presets' links are plain pipes (0); the shaped links of bench/netns_hosts have one.
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.burst_bytes and (self.duplex == "half" or self.mbps == 0):
            raise ValueError("a token bucket needs a full-duplex link with a rate (one sender per queue)")

    # a collective call's fixed cost on this link, paid once per call besides the per-step latency (NCCL's
    # baseLat: parallel/link.py's COLLECTIVE_MODELS); point-to-point messages do not pay it
    call_ms: float = 0.0

    def transmit_s(self, nbytes: float) -> float:
        return 0.0 if self.mbps == 0 or nbytes <= 0 else nbytes * 8 / (self.mbps * 1e6)

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage of one replica, per micro-batch: compute (+ TP collectives) seconds and the bytes its node
    sends to each neighbour (every TP rank's share of the wire together)."""

    fwd_s: float
    bwd_s: float
    fwd_bytes: float = 0.0  # activations to stage s + 1
    bwd_bytes: float = 0.0  # gradients to stage s - 1


@dataclasses.dataclass(frozen=True)
class ReplicaWork:
    """One DP replica's step: its stages, the link between stage s and s + 1 (`links[s]`), its micro-batches and
    schedule, and per stage the seconds of the DP tier's per-step collective (0: none) and of the outer sync."""

    stages: Sequence[Stage]
    links: Sequence[Link]
    micro_batches: int
    schedule: str = "afab"
    dp_s: Sequence[float] = ()
    outer_s: Sequence[float] = ()
    control_s: Sequence[float] = ()  # per stage: per-step agreements on the DP tier (a logged loss), no-overlap only
    # per stage: work done once per optimiser step, outside the micro-batch schedule (Muon's Newton-Schulz): it starts
    # when the stage's last backward and its DP all-reduce are done
    update_s: Sequence[float] = ()


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A replayed pipeline: when it ended, when each stage's last backward started, and when each stage's last op
    ended."""

    end_s: float
    last_backward_start_s: Tuple[float, ...]
    stage_end_s: Tuple[float, ...] = ()


class _Wire:
    """A link's busy intervals; a message takes the first gap at or after its ready time (first fit keeps FIFO
    order for one sender, and interleaves the two directions of a half-duplex link by time). A link with a token
    bucket starts the step with it full (the step's traffic fits the rate, so the bucket refills between steps)."""

    def __init__(self, link: Link) -> None:
        self.starts: List[float] = []
        self.ends: List[float] = []
        self.link = link
        self.tokens, self.tokens_at = link.burst_bytes, 0.0

    def send(self, ready: float, nbytes: float) -> float:
        """Put a message of `nbytes` on the wire (and the latency, if it holds the wire); returns when it left."""
        held = self.link.latency_s if self.link.latency_holds_wire else 0.0
        if not self.link.burst_bytes:
            return self.place(ready, self.link.transmit_s(nbytes) + held)
        # one sender per bucket (full duplex), its messages handed over in time order: leave after the last one
        t = max(ready, self.ends[-1] if self.ends else 0.0)
        rate = self.link.mbps * 1e6 / 8
        tokens = min(self.link.burst_bytes, self.tokens + rate * (t - self.tokens_at))
        paid = min(tokens, nbytes)
        seconds = (nbytes - paid) / rate
        self.tokens, self.tokens_at = tokens - paid, t + seconds
        return self.place(t, seconds + held)

    def place(self, ready: float, seconds: float) -> float:
        """Occupy the wire for `seconds` from the first free moment >= `ready`; returns when the message left."""
        t = ready
        i = bisect.bisect_right(self.ends, t)
        while i < len(self.starts) and self.starts[i] < t + seconds:
            t = max(t, self.ends[i])
            i += 1
        self.starts.insert(i, t)
        self.ends.insert(i, t + seconds)
        return t + seconds


def schedule_order(schedule: str, stage: int, stages: int, micro: int) -> List[Tuple[str, int]]:
    """The ops of `stage`, in the order its engine runs them: ("F" | "B", micro-batch)."""
    if schedule == "afab":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, micro)
        ops = [("F", i) for i in range(warm)]
        for i in range(micro - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(micro - warm, micro)]
    raise ValueError(f"unknown pipeline schedule {schedule!r} (afab, 1f1b)")


def replay(work: ReplicaWork, blocking: bool) -> Timeline:
    """Replay one step of one replica's pipeline (the module docstring); `blocking`: senders wait for their
    messages to arrive (the no-overlap bound)."""
    n, m = len(work.stages), work.micro_batches
    if len(work.links) < n - 1:
        raise ValueError(f"{n} stages need {n - 1} links, got {len(work.links)}")
    wires: Dict[Tuple[int, int], _Wire] = {}

    def wire(src: int, dst: int) -> _Wire:
        link = work.links[min(src, dst)]
        key = (min(src, dst), max(src, dst)) if link.duplex == "half" else (src, dst)
        return wires.setdefault(key, _Wire(link))

    orders = [schedule_order(work.schedule, s, n, m) for s in range(n)]
    at = [0] * n  # next op index per stage
    free = [0.0] * n  # when each stage's timeline is free
    arrived: Dict[Tuple[str, int, int], float] = {}  # ("F"|"B", stage that receives, micro) -> arrival time
    done: Dict[Tuple[str, int, int], float] = {}
    last_b = [0.0] * n
    remaining = n * 2 * m
    while remaining:
        progressed = False
        for s in range(n):
            while at[s] < len(orders[s]):
                kind, i = orders[s][at[s]]
                if kind == "F":
                    need = arrived.get(("F", s, i)) if s > 0 else 0.0
                else:
                    need = arrived.get(("B", s, i)) if s < n - 1 else done.get(("F", s, i))
                if need is None:
                    break
                start = max(free[s], need)
                st = work.stages[s]
                end = start + (st.fwd_s if kind == "F" else st.bwd_s)
                done[(kind, s, i)] = end
                if kind == "B":
                    last_b[s] = max(last_b[s], start)
                free[s] = end
                dst = s + 1 if kind == "F" else s - 1
                if 0 <= dst < n:
                    link = work.links[min(s, dst)]
                    nbytes = st.fwd_bytes if kind == "F" else st.bwd_bytes
                    held = link.latency_s if link.latency_holds_wire else 0.0
                    left = wire(s, dst).send(end, nbytes)
                    arrived[(kind, dst, i)] = left + link.latency_s - held
                    if blocking:  # a synchronous send: returns once the receiver has the message
                        free[s] = arrived[(kind, dst, i)]
                at[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {work.schedule} schedule deadlocked (a bug in schedule_order)")
    return Timeline(max(free), tuple(last_b), tuple(free))


@dataclasses.dataclass(frozen=True)
class StepBounds:
    """Seconds per optimiser step, averaged over an outer cycle: the full-overlap and the no-overlap bound."""

    lower_s: float
    upper_s: float
    # the step's agreements over the DP tier (the logged loss's mean over replicas): in `upper`, not in `lower`; a
    # single job whose outer sync streams still pays them every step (lower_s + agreements_s: what it achieves)
    agreements_s: float = 0.0


def step_bounds(replicas: Sequence[ReplicaWork], outer_every: int = 0, outer_overlap: int = 0) -> StepBounds:
    """The job's step time as a flushed step (the slowest replica paces it), with the per-step DP tier, each stage's
    once-per-step update after its last backward (and its DP all-reduce), and, every `outer_every` steps, the outer
    sync amortised over its cycle (hidden behind `outer_overlap` inner steps in the lower bound; 0: behind all H)."""
    lows, highs = [], []
    for work in replicas:
        n = len(work.stages)
        update, dp = list(work.update_s) or [0.0] * n, list(work.dp_s) or [0.0] * n
        for blocking, out in ((False, lows), (True, highs)):
            t = replay(work, blocking)
            if blocking:
                out.append(t.end_s + max(dp) + max(update) + max(list(work.control_s) or [0.0]))
            else:  # each stage: its all-reduce from its last backward's start, then its update
                out.append(max([t.end_s] + [max(e, b + d) + u for e, b, d, u in
                                            zip(t.stage_end_s, t.last_backward_start_s, dp, update)]))
    return _with_outer(replicas, outer_every, max(lows), max(highs), outer_overlap)


def ddp_step_s(replicas: Sequence[ReplicaWork], outer_every: int = 0) -> float:
    """A third bound, between the two: blocking sends (nanotron's point-to-point), each stage's per-step DP
    all-reduce bucketed behind its backward from its last backward's start (torch DDP), then its update and the
    step's agreements; an outer sync, if any, stops every replica (`python -m nanotron_ext.advise` times a per-step
    all-reduce system's best user by it)."""
    step = 0.0
    for work in replicas:
        n = len(work.stages)
        update, dp = list(work.update_s) or [0.0] * n, list(work.dp_s) or [0.0] * n
        t = replay(work, True)
        step = max(step, max([t.end_s] + [max(e, b + d) + u for e, b, d, u in
                                          zip(t.stage_end_s, t.last_backward_start_s, dp, update)])
                   + max(list(work.control_s) or [0.0]))
    return _with_outer(replicas, outer_every, step, step).upper_s


def _with_outer(replicas: Sequence[ReplicaWork], outer_every: int, lower: float, upper: float,
                overlap: int = 0) -> StepBounds:
    """Per-step bounds with the outer sync amortised over its cycle: in the lower bound it runs behind `overlap`
    inner steps (0: the whole cycle's H) and a cycle waits for what they did not hide; in the upper one it stops
    every replica."""
    if outer_every:
        outer = max((max(w.outer_s or [0.0]) for w in replicas), default=0.0)
        behind = min(overlap or outer_every, outer_every)
        lower = (max(outer_every * lower, outer) if behind == outer_every  # the same sum, in the committed form
                 else outer_every * lower + max(0.0, outer - behind * lower)) / outer_every
        upper = upper + outer / outer_every
    agreements = max((max(list(w.control_s) or [0.0]) for w in replicas), default=0.0)
    return StepBounds(lower, upper, agreements)


def with_outer_sync(replicas: Sequence[Any], outer_every: int, lower: float, upper: float,
                    overlap: int = 0) -> StepBounds:
    """Per-step bounds `lower`, `upper` of a job without its outer sync, with the sync (each replica's `outer_s`) of
    every `outer_every` steps added as step_bounds adds it (hidden behind `overlap` inner steps in the lower bound)."""
    return _with_outer(replicas, outer_every, lower, upper, overlap)


def link_busy_s(work: ReplicaWork, s: int, blocking: bool = False) -> float:
    """Seconds per micro-batch the link between stages s and s + 1 is busy: s's activations and s + 1's gradients on
    one wire when half duplex, the busier direction when full; a latency that holds the wire counts too."""
    link = work.links[s]
    held = link.latency_s if link.latency_holds_wire else 0.0
    fwd = link.transmit_s(work.stages[s].fwd_bytes) + held
    bwd = link.transmit_s(work.stages[s + 1].bwd_bytes) + held
    return fwd + bwd if link.duplex == "half" else max(fwd, bwd)


def steady_bounds(replicas: Sequence[ReplicaWork], outer_every: int = 0, outer_overlap: int = 0) -> StepBounds:
    """The job's step time in steady state: a pipeline kept full across steps (no fill, no drain), so a step takes
    its micro-batches times the busiest resource's time per micro-batch, a stage's compute or a link's wire, plus
    the stage's once-per-step update (its Newton-Schulz: nothing else runs on that stage meanwhile). The
    full-overlap bound: stage s is busy m (F + B) + update per step; the no-overlap bound adds to each stage its
    own sends' transfer and latency per micro-batch (a synchronous send) and its DP all-reduce and agreements. A
    link is busy m times `link_busy_s` per step in both. What a tokens/s meter reads over a window of a long run
    (ResBM Table 3: 'designed to measure steady-state throughput'); `step_bounds` is one flushed step's."""
    lows, highs = [], []
    for work in replicas:
        n, m = len(work.stages), work.micro_batches
        update = list(work.update_s) or [0.0] * n
        dp, control = list(work.dp_s) or [0.0] * n, list(work.control_s) or [0.0] * n
        wires = [m * link_busy_s(work, s) for s in range(n - 1)]
        low, high = list(wires), list(wires)
        for s, st in enumerate(work.stages):
            low.append(m * (st.fwd_s + st.bwd_s) + update[s])
            sends = 0.0
            if s + 1 < n:
                sends += work.links[s].transmit_s(st.fwd_bytes) + work.links[s].latency_s
            if s > 0:
                sends += work.links[s - 1].transmit_s(st.bwd_bytes) + work.links[s - 1].latency_s
            high.append(m * (st.fwd_s + st.bwd_s + sends) + update[s] + dp[s] + control[s])
        lows.append(max(low))
        highs.append(max(high))
    return _with_outer(replicas, outer_every, max(lows), max(highs), outer_overlap)


def ring_seconds(ops: Dict[str, Tuple[float, float]], group: int, link: Link, sharing: int = 1) -> float:
    """Seconds of one rank's collectives {op: (bytes, calls)} on a ring of `group` ranks over `link`, with
    `sharing` rings on the same uplink (a node's TP ranks each in their own DP ring): the bandwidth term is
    `sharing` times longer, the latency term is not."""
    from nanotron_ext.parallel.link import LinkSpec, ring_collective_s

    total = 0.0
    for op, (nbytes, calls) in ops.items():
        if calls <= 0:
            continue
        per_call = nbytes / calls
        bw = ring_collective_s(op, per_call, group, LinkSpec(link.mbps, 0.0), link.duplex) * sharing
        lat = ring_collective_s(op, 0, group, LinkSpec(0.0, link.latency_ms), link.duplex)
        fixed = link.call_ms / 1e3 if group > 1 and lat + bw > 0 else 0.0
        total += calls * (bw + lat + fixed)
    return total


def time_to_target(curve: Sequence[Sequence[float]], target: float, step_s: float) -> Optional[float]:
    """Seconds to the first validation at or below `target` on a curve [[step, loss]] at `step_s` per step."""
    return next((step * step_s for step, loss in curve if loss <= target), None)
