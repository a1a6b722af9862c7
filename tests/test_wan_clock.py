"""The model clock's replay (nanotron_ext/bench/clock/replay.py) against closed forms written here by hand: GPipe's
and 1F1B's bubble (m + p - 1)(f + b), a link-bound pipeline, half duplex, the DP tier's overlap bounds, the outer
sync's amortisation and the ring forms with a shared uplink; the steady state, a once-per-step update and NCCL's
collective model (issue 54)."""
from __future__ import annotations

import pytest

from nanotron_ext.bench.clock import (
    Link,
    ReplicaWork,
    Stage,
    replay,
    ring_seconds,
    schedule_order,
    steady_bounds,
    step_bounds,
)

FREE = Link(0.0)


def _pipe(p: int, m: int, f: float, b: float, schedule: str, link: Link = FREE, nbytes: float = 0.0,
          **extra: object) -> ReplicaWork:
    return ReplicaWork([Stage(f, b, nbytes, nbytes)] * p, [link] * (p - 1), m, schedule, **extra)  # type: ignore


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8), (4, 2), (3, 1)])
def test_equal_stages_over_free_links_take_the_bubble_closed_form(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    for blocking in (False, True):
        assert replay(_pipe(p, m, f, b, schedule), blocking).end_s == pytest.approx((m + p - 1) * (f + b))


def test_1f1b_orders_warm_up_forwards_then_alternates() -> None:
    assert schedule_order("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                               ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                               ("F", 3), ("B", 3)]
    with pytest.raises(ValueError, match="interleaved"):
        schedule_order("interleaved", 0, 2, 2)


def test_a_link_bound_pipeline_serialises_its_messages() -> None:
    """No compute, 2 stages, m messages of tx seconds each way. AFAB: stage 1's backwards wait for its last forward,
    so the gradients follow the activations: 2 m tx + 2 lat. 1F1B (no latency: stage 0's later forwards wait for a
    round trip): each gradient leaves when its activation arrived, overlapping the wire of the other direction:
    (m + 1) tx, unless the link is half duplex and both directions share one wire (2 m tx)."""
    m, nbytes, tx, lat = 4, 1e6, 1.0, 0.005  # 1 MB at 8 Mbit/s: 1 s each, 5 ms latency
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", Link(8.0, 5.0), nbytes), False).end_s == pytest.approx(
        2 * m * tx + 2 * lat)
    assert replay(_pipe(2, m, 0.0, 0.0, "1f1b", Link(8.0), nbytes), False).end_s == pytest.approx((m + 1) * tx)
    assert replay(_pipe(2, m, 0.0, 0.0, "1f1b", Link(8.0, 0.0, "half"), nbytes), False).end_s == pytest.approx(
        2 * m * tx)


def test_blocking_sends_cost_the_sender_what_overlap_hides() -> None:
    """Stage 0 computes 1 s per forward and sends 1 s of activation over a link of latency a; stage 1 computes
    nothing and returns empty gradients (one more latency). Overlapped, stage 0's forwards end at m s and the last
    activation lands 1 + a later: m + 1 + 2a. A synchronous send keeps the sender until the receiver has the
    message, so every transfer and latency is on the senders' timelines, the gradients' too: m (2 + 2a)."""
    m, a = 4, 0.25
    work = ReplicaWork([Stage(1.0, 0.0, 1e6, 0.0), Stage(0.0, 0.0)], [Link(8.0, a * 1e3)], m, "afab")
    overlapped, blocking = replay(work, False), replay(work, True)
    assert overlapped.end_s == pytest.approx(m * 1.0 + 1.0 + 2 * a)
    assert blocking.end_s == pytest.approx(m * (2.0 + 2 * a))


def test_dp_tier_bounds_overlap_from_the_last_backward_or_follow_the_flush() -> None:
    """One stage, m micro-batches of f + b: the all-reduce of d seconds starts at the last backward's start
    (lower) or after the step (upper)."""
    m, f, b, d = 3, 1.0, 2.0, 5.0
    bounds = step_bounds([_pipe(1, m, f, b, "afab", dp_s=[d])])
    last_b_start = m * f + (m - 1) * b
    assert bounds.lower_s == pytest.approx(last_b_start + d)
    assert bounds.upper_s == pytest.approx(m * (f + b) + d)


def test_per_step_agreements_cost_only_the_no_overlap_bound() -> None:
    plain = step_bounds([_pipe(1, 2, 1.0, 2.0, "afab")])
    agreed = step_bounds([_pipe(1, 2, 1.0, 2.0, "afab", control_s=[0.1])])
    assert agreed.upper_s == pytest.approx(plain.upper_s + 0.1) and agreed.lower_s == plain.lower_s
    assert agreed.agreements_s == pytest.approx(0.1) and plain.agreements_s == 0.0  # kept beside, for a streaming job


def test_the_outer_sync_is_amortised_over_its_cycle_or_hidden_behind_it() -> None:
    step, outer, h = 3.0, 12.0, 5
    bounds = step_bounds([_pipe(1, 1, 1.0, 2.0, "afab", outer_s=[outer])], outer_every=h)
    assert bounds.upper_s == pytest.approx(step + outer / h)
    assert bounds.lower_s == pytest.approx(step)  # 12 s hides behind 5 x 3 s
    slow = step_bounds([_pipe(1, 1, 1.0, 2.0, "afab", outer_s=[30.0])], outer_every=h)
    assert slow.lower_s == pytest.approx(30.0 / h)


def test_a_streaming_sync_hides_only_behind_its_delay() -> None:
    """Streaming DiLoCo's tau: a cycle of H steps waits for what of the sync tau steps did not hide."""
    step, outer, h = 3.0, 12.0, 5
    work = [_pipe(1, 1, 1.0, 2.0, "afab", outer_s=[outer])]
    for tau, cycle in ((1, h * step + (outer - step)), (2, h * step + (outer - 2 * step)), (4, h * step),
                       (h, h * step)):
        b = step_bounds(work, outer_every=h, outer_overlap=tau)
        assert b.lower_s == pytest.approx(cycle / h), tau
        assert b.upper_s == pytest.approx(step + outer / h)  # a blocking sync's bound is not the delay's
    assert steady_bounds(work, outer_every=h, outer_overlap=1).lower_s == pytest.approx((h * step + outer - step) / h)


def test_the_slowest_replica_paces_the_job() -> None:
    fast, slow = _pipe(2, 4, 1.0, 2.0, "afab"), _pipe(2, 4, 1.0, 2.0, "afab", Link(8.0, 50.0), 1e6)
    assert step_bounds([fast, slow]).lower_s == pytest.approx(step_bounds([slow]).lower_s)
    assert step_bounds([fast, slow]).lower_s > step_bounds([fast]).lower_s


def test_ring_seconds_share_the_uplink_between_a_nodes_rings() -> None:
    """All-reduce of N bytes on a ring of p: 2 (p-1)/p N 8 / B + 2 (p-1) lat; two rings on one uplink double the
    bandwidth term only; calls multiply the latency term."""
    n, p, link = 1e6, 4, Link(80.0, 10.0)
    one = 2 * (p - 1) / p * n * 8 / 80e6
    assert ring_seconds({"all_reduce": (n, 1)}, p, link) == pytest.approx(one + 2 * (p - 1) * 0.01)
    assert ring_seconds({"all_reduce": (n, 1)}, p, link, sharing=2) == pytest.approx(2 * one + 2 * (p - 1) * 0.01)
    assert ring_seconds({"all_reduce": (n, 4)}, p, link) == pytest.approx(one + 4 * 2 * (p - 1) * 0.01)
    assert ring_seconds({"all_reduce": (n, 1)}, 1, link) == 0.0


def test_a_latency_that_holds_the_wire_serialises_it_with_the_transfer() -> None:
    """ProtocolNanoGPT's meter starts a message only when the last one arrived: with no compute, AFAB and m
    messages of tx seconds and latency a each way, the forwards land m (tx + a) after the start and the gradients
    m (tx + a) after that; a pipelined latency costs each direction once: 2 m tx + 2 a."""
    m, tx, a = 4, 1.0, 0.25
    held = Link(8.0, a * 1e3, "full", latency_holds_wire=True)
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", held, 1e6), False).end_s == pytest.approx(2 * m * (tx + a))
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", Link(8.0, a * 1e3), 1e6), False).end_s == pytest.approx(
        2 * m * tx + 2 * a)
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", held, 1e6), True).end_s == pytest.approx(2 * m * (tx + a))


def test_the_outer_steps_stage_broadcast_costs_each_later_stage_a_copy_over_the_first_stages_uplink() -> None:
    """Heterogeneous SparseLoCo's embedding fold: after an outer sync the first stage broadcasts N bytes to the p - 1
    later stages on its pipeline group (one per TP rank, all on the node's uplink): (p - 1) tp N 8 / B + calls x
    latency. Only what the outer step sends beyond the inner one counts, and point-to-point sends do not."""
    from nanotron_ext.bench.clock import stage_broadcast_s

    n, p, tp, link = 3e6, 4, 2, Link(200.0, 50.0)
    inner = {"pp": {"send:fwd": {"bytes": 10, "calls": 1}, "broadcast:embedding_fold": {"bytes": 64, "calls": 1}}}
    outer = {"pp": {"send:fwd": {"bytes": 999, "calls": 3},
                    "broadcast:embedding_fold": {"bytes": 64 + n, "calls": 2}}}
    assert stage_broadcast_s(outer, inner, p, tp, link) == pytest.approx((p - 1) * tp * n * 8 / 200e6 + 1 * 0.05)
    assert stage_broadcast_s(outer, inner, 1, tp, link) == 0.0  # no later stage
    assert stage_broadcast_s(inner, inner, p, tp, link) == 0.0  # nothing beyond the inner step


def test_a_token_bucket_lets_its_depth_through_at_line_rate_then_the_rate_holds() -> None:
    """tc tbf's bucket (the shaped links of bench/netns_hosts): b bytes leave at once after an idle spell, the rest
    at the rate R. No compute, AFAB, m messages of n bytes each way, all ready at once: each direction's last message
    leaves (m n - b) / R after its first is ready, so the step is 2 (m n - b) / R (a plain pipe: 2 m n / R). A sender
    whose messages come slower than the bucket refills never waits: m forwards of f seconds, each sending n < b
    with n / R < f, end at m f (a plain pipe adds the last message's n / R)."""
    m, n, rate, b = 4, 1e6, 1e6, 1.5e6  # bytes, bytes/s: 8 Mbit/s
    bucket = Link(8.0, burst_bytes=b)
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", bucket, n), False).end_s == pytest.approx(2 * (m * n - b) / rate)
    assert replay(_pipe(2, m, 0.0, 0.0, "afab", Link(8.0), n), False).end_s == pytest.approx(2 * m * n / rate)
    f, small = 1.0, 0.5e6
    work = lambda link: ReplicaWork([Stage(f, 0.0, small, 0.0), Stage(0.0, 0.0)], [link], m, "afab")  # noqa: E731
    assert replay(work(Link(8.0, burst_bytes=1e6)), False).end_s == pytest.approx(m * f)
    assert replay(work(Link(8.0)), False).end_s == pytest.approx(m * f + small / rate)
    with pytest.raises(ValueError, match="full-duplex"):
        Link(8.0, 0.0, "half", burst_bytes=b)


# -- issue 54: the steady state, once-per-step updates, NCCL's collective model ------------------------------------

def test_steady_state_of_a_link_bound_half_duplex_pipeline_is_the_links_rate() -> None:
    """ResBM Table 3's accounting: p stages over half-duplex links, each micro-batch sends `n` bytes each way. In
    steady state the step is m micro-batches x the busiest resource: here the link, 2 n 8 / B per micro-batch (both
    directions share it), so tokens/s = tokens per micro-batch x B / (2 n 8): 80e6 / (2 x 4096 x 16) per token of
    4096 bf16 activations (610.35 tok/s), with no fill or drain. The flushed step of the same pipeline is longer
    (GPipe's fill and drain over p - 1 links)."""
    p, m, tokens, d = 8, 16, 1024, 4096
    n = tokens * d * 2  # one micro-batch's bf16 activations (and gradients)
    work = _pipe(p, m, 0.01, 0.02, "afab", Link(80.0, 0.0, "half"), n)
    steady = steady_bounds([work])
    assert steady.lower_s == pytest.approx(m * 2 * n * 8 / 80e6)
    assert m * tokens / steady.lower_s == pytest.approx(80e6 / (2 * d * 16))
    assert step_bounds([work]).lower_s > 1.2 * steady.lower_s


def test_steady_state_of_a_compute_bound_pipeline_is_its_slowest_stage() -> None:
    """Free links: the steady step is m (f + b) of the slowest stage, not GPipe's (m + p - 1)(f + b); the no-overlap
    bound adds a stage's own sends (transfer and latency, each direction) per micro-batch."""
    p, m, f, b = 4, 8, 1.0, 2.0
    assert steady_bounds([_pipe(p, m, f, b, "afab")]).lower_s == pytest.approx(m * (f + b))
    slow = ReplicaWork([Stage(f, b)] * 3 + [Stage(2 * f, 2 * b)], [FREE] * 3, m)
    assert steady_bounds([slow]).lower_s == pytest.approx(m * 2 * (f + b))
    linked = _pipe(3, m, f, b, "afab", Link(8.0, 100.0), 1e6)  # 1 s per message, 0.1 s latency
    bounds = steady_bounds([linked])
    assert bounds.lower_s == pytest.approx(m * (f + b))  # a link busy 1 s per micro-batch each way: not the bottleneck
    assert bounds.upper_s == pytest.approx(m * (f + b + 2 * (1.0 + 0.1)))  # the middle stage sends both ways


def test_a_once_per_step_update_is_priced_once_not_per_micro_batch() -> None:
    """Each stage's update (Muon's Newton-Schulz) runs once after its last backward: a flushed GPipe step over free
    links is (m + p - 1)(f + b) + u, not (m + p - 1)(f + b + u / m), which is what spreading u over the micro-batches
    gives (the bubble then carries u too); the steady state is m (f + b) + u."""
    p, m, f, b, u = 8, 16, 0.03, 0.06, 0.5
    work = _pipe(p, m, f, b, "afab", update_s=[u] * p)
    assert step_bounds([work]).lower_s == pytest.approx((m + p - 1) * (f + b) + u)
    assert step_bounds([work]).upper_s == pytest.approx((m + p - 1) * (f + b) + u)
    spread = _pipe(p, m, f + u / m / 3, b + 2 * u / m / 3, "afab")
    assert step_bounds([spread]).lower_s == pytest.approx((m + p - 1) * (f + b + u / m))
    assert steady_bounds([work]).lower_s == pytest.approx(m * (f + b) + u)


def test_a_collective_pays_nccls_base_per_call_and_latency_per_step() -> None:
    """The clock's datacenter tier under NCCL's model (parallel/link.py CollectiveModel): all-reduce of N bytes on
    p ranks = base + 2 (p - 1) step + 2 (p - 1)/p N / busbw, per call; numbers written out: A100 NVLink 3, 240 GB/s,
    8.4 us per call, 3.4 us per step; 8 MiB on 4 ranks: 8.4 + 6 x 3.4 + 1.5 x 8,388,608 / 240e9 s."""
    link = Link(240e9 * 8 / 1e6, 0.0034, call_ms=0.0084)
    n, p = 8 * 2 ** 20, 4
    expected = 8.4e-6 + 6 * 3.4e-6 + 1.5 * n / 240e9
    assert ring_seconds({"all_reduce": (n, 1)}, p, link) == pytest.approx(expected)
    assert ring_seconds({"all_reduce": (2 * n, 2)}, p, link) == pytest.approx(2 * expected)
    # a small message is latency-bound: 1 KiB costs 28.8 us, not its 6.4 ns of bytes
    assert ring_seconds({"all_reduce": (1024, 1)}, p, link) == pytest.approx(28.8e-6 + 1.5 * 1024 / 240e9)


def test_the_streaming_delay_reaches_the_clock_through_the_dp_sync() -> None:
    from nanotron_ext.config import load_config
    from nanotron_ext.registry import DP_SYNCS

    for sets, tau in (([], 0), (["sparseloco.streaming.delay=2"], 2)):
        cfg = load_config("examples/config_tiny_sparseloco.yaml", sets)
        assert DP_SYNCS.owner(cfg.parallelism.dp_sync).outer_overlap(cfg) == tau
    cfg = load_config("examples/config_tiny_llama.yaml", [])
    assert DP_SYNCS.owner(cfg.parallelism.dp_sync).outer_overlap(cfg) == 0  # a per-step all-reduce: nothing behind
