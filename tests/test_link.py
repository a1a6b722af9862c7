"""Link emulation: LinkEmulator arithmetic against closed forms, the YAML entry point, and the
emulated link end to end through AccountedP2P on two gloo ranks (slow)."""
from __future__ import annotations

import math
import time

import pytest
import torch
import yaml

from nanotron_ext.config.schema import ConfigError, LinkConfig
from nanotron_ext.parallel.link import LinkEmulator, LinkSpec, link_emulator_from_config
from tests.helpers.dist import run_distributed

NOW = 1_000.0  # an arbitrary wall-clock origin; schedule_send takes `now` explicitly in unit tests


def closed_form(nbytes: int, mbps: float, latency_ms: float) -> float:
    """Seconds from send to arrival of one message on an idle link."""
    return (nbytes * 8 / (mbps * 1e6) if mbps else 0.0) + latency_ms / 1e3


# -- LinkSpec / LinkEmulator arithmetic --------------------------------------------------------
@pytest.mark.parametrize("nbytes,mbps,latency_ms", [(1, 80, 0), (1_000_000, 80, 5), (123_457, 1.5, 40), (0, 10, 3)])
def test_single_message_arrives_at_closed_form(nbytes: int, mbps: float, latency_ms: float) -> None:
    link = LinkEmulator(LinkSpec(bandwidth_mbps=mbps, latency_ms=latency_ms))
    assert link.schedule_send(0, 1, nbytes, now=NOW) == pytest.approx(
        NOW + nbytes * 8 / (mbps * 1e6) + latency_ms / 1e3, rel=0, abs=1e-9
    )


def test_back_to_back_messages_serialise() -> None:
    n, mbps, lat = 250_000, 20.0, 10.0
    tx = n * 8 / (mbps * 1e6)  # 0.1 s
    link = LinkEmulator(LinkSpec(mbps, lat))
    arrivals = [link.schedule_send(0, 1, n, now=NOW) for _ in range(3)]
    # the k-th message leaves when the (k-1)-th has left; latency overlaps, it is not paid per message
    assert arrivals == pytest.approx([NOW + k * tx + lat / 1e3 for k in (1, 2, 3)], abs=1e-9)
    # a message sent while the link is busy waits for it, whatever its own send time
    mid = link.schedule_send(0, 1, n, now=NOW + 0.05)
    assert mid == pytest.approx(NOW + 4 * tx + lat / 1e3, abs=1e-9)


def test_idle_time_is_not_banked() -> None:
    n, mbps = 1_000_000, 8.0
    tx = n * 8 / (mbps * 1e6)  # 1 s
    link = LinkEmulator(LinkSpec(mbps, 0.0))
    link.schedule_send(0, 1, n, now=NOW)
    # the link sat idle for 9 s; a burst after that still pays the full rate for every message
    later = NOW + 10.0
    assert [link.schedule_send(0, 1, n, now=later) for _ in range(2)] == pytest.approx([later + tx, later + 2 * tx])


def test_directions_are_independent_links() -> None:
    link = LinkEmulator(LinkSpec(8.0, 1.0))
    link.schedule_send(0, 1, 1_000_000, now=NOW)  # busy 0->1 for 1 s
    assert link.schedule_send(1, 0, 1_000, now=NOW) == pytest.approx(NOW + closed_form(1_000, 8.0, 1.0))
    assert link.schedule_send(1, 2, 1_000, now=NOW) == pytest.approx(NOW + closed_form(1_000, 8.0, 1.0))


def test_per_pair_override_applies_in_both_directions() -> None:
    slow, fast = LinkSpec(2.0, 30.0), LinkSpec(1000.0, 0.5)
    link = LinkEmulator(fast, {(0, 1): slow})
    assert link.spec(0, 1) == link.spec(1, 0) == slow
    assert link.spec(1, 2) == link.spec(2, 1) == fast
    n = 50_000
    assert link.schedule_send(1, 0, n, now=NOW) == pytest.approx(NOW + closed_form(n, 2.0, 30.0))
    assert link.schedule_send(0, 1, n, now=NOW) == pytest.approx(NOW + closed_form(n, 2.0, 30.0))
    assert link.schedule_send(2, 1, n, now=NOW) == pytest.approx(NOW + closed_form(n, 1000.0, 0.5))


def test_exact_direction_wins_over_reverse_pair() -> None:
    up, down = LinkSpec(10.0, 1.0), LinkSpec(100.0, 2.0)
    link = LinkEmulator(LinkSpec(), {(0, 1): up, (1, 0): down})
    assert (link.spec(0, 1), link.spec(1, 0)) == (up, down)


def test_unlimited_bandwidth_is_latency_only() -> None:
    link = LinkEmulator(LinkSpec(bandwidth_mbps=0.0, latency_ms=7.0))
    assert LinkSpec().transmit_s(10**12) == 0.0
    # any size, any number back to back: nothing serialises, each arrives after the latency
    assert [link.schedule_send(0, 1, n, now=NOW) for n in (1, 10**9, 10**9)] == pytest.approx([NOW + 0.007] * 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bandwidth_mbps": -1.0},
        {"latency_ms": -0.1},
        {"bandwidth_mbps": math.nan},
        {"latency_ms": math.nan},
        {"latency_ms": math.inf},
        {"bandwidth_mbps": math.inf},
    ],
)
def test_bad_specs_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LinkSpec(**kwargs)


def test_nan_bandwidth_cannot_silently_disable_the_delay() -> None:
    # before the fix a NaN spec was accepted: every arrival became NaN and wait_until never slept
    with pytest.raises(ValueError, match="bandwidth_mbps"):
        LinkEmulator(LinkSpec(bandwidth_mbps=float("nan"), latency_ms=5.0))


def test_schedule_send_defaults_to_wall_clock_and_wait_until_sleeps() -> None:
    link = LinkEmulator(LinkSpec(bandwidth_mbps=8.0, latency_ms=20.0))
    n = 50_000  # 50 ms + 20 ms
    before = time.time()
    arrival = link.schedule_send(0, 1, n)
    after = time.time()
    assert before + 0.07 - 1e-9 <= arrival <= after + 0.07 + 1e-9
    link.wait_until(arrival)
    assert time.time() >= arrival - 1e-3
    t = time.time()
    LinkEmulator.wait_until(t - 5.0)  # already arrived: no sleep
    assert time.time() - t < 0.05


# -- YAML entry point ----------------------------------------------------------------------------
def _link_config(text: str) -> LinkConfig:
    return LinkConfig(**yaml.safe_load(text)["parallelism"]["link"])


def test_from_config_disabled_is_none() -> None:
    assert link_emulator_from_config(LinkConfig()) is None
    assert link_emulator_from_config(_link_config("parallelism: {link: {enabled: false, bandwidth_mbps: 80}}")) is None


def test_from_config_builds_default_and_pair_overrides() -> None:
    cfg = _link_config(
        """
parallelism:
  link:
    enabled: true
    bandwidth_mbps: 80
    latency_ms: 5
    per_stage_pair:
      "1-2": {bandwidth_mbps: 10, latency_ms: 50}
      "0-1": {latency_ms: 1}
"""
    )
    link = link_emulator_from_config(cfg)
    assert isinstance(link, LinkEmulator)
    assert link.default == LinkSpec(80.0, 5.0)
    assert link.spec(1, 2) == link.spec(2, 1) == LinkSpec(10.0, 50.0)
    assert link.spec(0, 1) == link.spec(1, 0) == LinkSpec(80.0, 1.0)  # bandwidth inherited from the default
    assert link.spec(2, 3) == LinkSpec(80.0, 5.0)
    n = 125_000
    assert link.schedule_send(2, 1, n, now=NOW) == pytest.approx(NOW + closed_form(n, 10.0, 50.0))


def test_from_config_enabled_with_zeros_is_a_no_delay_link() -> None:
    link = link_emulator_from_config(LinkConfig(enabled=True))
    assert link is not None and link.schedule_send(0, 1, 10**9, now=NOW) == NOW


@pytest.mark.parametrize(
    "pairs", [{"0-0": {"latency_ms": 1}}, {"0-1": {"bandwidth_mbps": -5}}, {"0-1": {"latency_ms": float("nan")}}]
)
def test_from_config_rejects_bad_pairs(pairs: dict) -> None:
    with pytest.raises(ValueError, match="per_stage_pair"):
        link_emulator_from_config(LinkConfig(enabled=True, per_stage_pair=pairs))


def test_schema_rejects_bad_pair_keys_before_the_emulator() -> None:
    with pytest.raises(ConfigError):
        LinkConfig(enabled=True, per_stage_pair={"a-b": {}})


# -- AccountedP2P: the clock travels on the P2P's device ------------------------------------------
def test_link_clock_is_sent_and_received_on_the_p2p_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL group cannot carry a CPU tensor, so the clock must live on p2p.device like nanotron's
    own metadata. 'meta' stands in for a non-CPU device; the transport is faked."""
    import nanotron.distributed as ndist
    from nanotron.parallel.pipeline_parallel.p2p import P2P

    from nanotron_ext.parallel.p2p import AccountedP2P

    devices = []

    class Stop(Exception):
        pass

    def fake_recv(tensor: torch.Tensor, **_: object) -> None:
        devices.append(("recv", tensor.device.type))
        raise Stop  # a meta tensor has no value to read; the device is what is checked

    monkeypatch.setattr(ndist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(ndist, "get_global_rank", lambda group, group_rank: group_rank)
    monkeypatch.setattr(ndist, "isend", lambda tensor, **_: devices.append(("send", tensor.device.type)))
    monkeypatch.setattr(ndist, "recv", fake_recv)
    monkeypatch.setattr(P2P, "_send_meta", lambda self, tensor, to_rank, tag: None)

    p2p = AccountedP2P(pg=None, device=torch.device("meta"), link=LinkEmulator(LinkSpec(8.0, 0.0)))
    p2p.isend_tensors([torch.empty(4, device="meta")], to_rank=1)
    with pytest.raises(Stop):
        p2p.recv_tensors(1, from_rank=1)
    assert devices == [("send", "meta"), ("send", "meta"), ("recv", "meta")]


def test_ideal_link_sends_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link with unlimited bandwidth and no latency adds no message: only the data is sent."""
    import nanotron.distributed as ndist
    from nanotron.parallel.pipeline_parallel.p2p import P2P

    from nanotron_ext.parallel.p2p import AccountedP2P

    sent = []
    monkeypatch.setattr(ndist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(ndist, "get_global_rank", lambda group, group_rank: group_rank)
    monkeypatch.setattr(ndist, "isend", lambda tensor, **_: sent.append(tensor.dtype))
    monkeypatch.setattr(P2P, "_send_meta", lambda self, tensor, to_rank, tag: None)
    ideal = LinkEmulator(LinkSpec(), per_pair={(0, 2): LinkSpec(8.0, 0.0)})
    p2p = AccountedP2P(pg=None, device=torch.device("cpu"), link=ideal)
    p2p.isend_tensors([torch.zeros(4)], to_rank=1)
    assert sent == [torch.float32]  # data only
    p2p.isend_tensors([torch.zeros(4)], to_rank=2)
    assert sent == [torch.float32, torch.float64, torch.float32]  # the shaped pair still gets its clock


def test_data_direction_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Activations (to a later stage) are fwd on both ends; gradients (to an earlier stage) bwd."""
    import nanotron.distributed as ndist

    from nanotron_ext.parallel.p2p import AccountedP2P

    p2p = AccountedP2P(pg=None, device=torch.device("cpu"))
    labels = {}
    for me in (0, 1, 2):
        monkeypatch.setattr(ndist, "get_rank", lambda group=None, me=me: me)
        labels[me] = {(peer, sending): p2p._direction(peer, sending) for peer in (0, 1, 2) if peer != me
                      for sending in (True, False)}
    assert labels[1] == {(2, True): "fwd", (0, False): "fwd", (0, True): "bwd", (2, False): "bwd"}
    assert labels[0] == {(1, True): "fwd", (2, True): "fwd", (1, False): "bwd", (2, False): "bwd"}
    assert labels[2] == {(0, True): "bwd", (1, True): "bwd", (0, False): "fwd", (1, False): "fwd"}


# -- end to end: two gloo ranks, pp=2 ------------------------------------------------------------
E2E_MBPS = 4.0  # 100 kB take 0.2 s: large against scheduling noise on a busy 2-core machine
E2E_BYTES = 100_000
E2E_COUNT = 3


def _e2e_worker(mbps: float, nbytes: int, count: int) -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.p2p import AccountedP2P

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    p2p = AccountedP2P(ctx.pp_pg, torch.device("cpu"), link=LinkEmulator(LinkSpec(bandwidth_mbps=mbps)))
    rank = dist.get_rank(ctx.pp_pg)
    ledger = get_ledger()
    x = torch.arange(nbytes // 4, dtype=torch.float32)
    dist.barrier(ctx.world_pg)
    ledger.reset()
    start, first_send_done, ok = time.time(), None, True
    for _ in range(count):
        if rank == 0:
            p2p.send_tensors([x], to_rank=1)
            first_send_done = first_send_done or time.time()
        else:
            ok &= bool(torch.equal(p2p.recv_tensors(1, from_rank=0)[0], x))
    end = time.time()
    # one small gradient back to the first stage, after the timing, to check the bwd labels
    grad = torch.ones(256)
    if rank == 1:
        p2p.send_tensors([grad], to_rank=0)
    else:
        ok &= bool(torch.equal(p2p.recv_tensors(1, from_rank=1)[0], grad))
    return {
        "start": start, "end": end, "first_send_done": first_send_done, "ok": ok,
        "ledger": ledger.snapshot(),
    }


@pytest.mark.slow
def test_emulated_link_end_to_end_two_ranks() -> None:
    sender, receiver = run_distributed(_e2e_worker, 2, E2E_MBPS, E2E_BYTES, E2E_COUNT)
    tx = E2E_BYTES * 8 / (E2E_MBPS * 1e6)
    assert sender["ok"] and receiver["ok"]

    # all ranks share this host's wall clock: time the receiver's completion from the first send
    completion = receiver["end"] - sender["start"]
    assert E2E_COUNT * tx - 1e-3 <= completion < E2E_COUNT * tx + 0.5, (completion, E2E_COUNT * tx)

    # overlap: the sender does not pay for transmission. Its first send returns as soon as the
    # receiver has posted the matching recv (gloo sends rendezvous), far before the 0.2 s the
    # message occupies the link; later sends wait only for the receiver to consume the previous
    # message, so the sender finishes before the last message has crossed.
    assert sender["first_send_done"] - sender["start"] < tx / 2
    assert sender["end"] - sender["start"] < completion - tx / 2

    # ledger: payload bytes exactly as data, one float64 clock per message
    pp_send = sender["ledger"]["pp"]
    assert pp_send["send:fwd"] == {"bytes": E2E_COUNT * E2E_BYTES, "calls": E2E_COUNT}
    assert pp_send["send:link-clock"] == {"bytes": 8 * E2E_COUNT, "calls": E2E_COUNT}
    pp_recv = receiver["ledger"]["pp"]
    # activations received from the earlier stage are "fwd" (they were recorded as "recv:bwd" before the fix)
    assert pp_recv["recv:fwd"] == {"bytes": E2E_COUNT * E2E_BYTES, "calls": E2E_COUNT}
    assert pp_recv["recv:link-clock"] == {"bytes": 8 * E2E_COUNT, "calls": E2E_COUNT}
    # the gradient going back: send:bwd on the later stage, recv:bwd on the earlier one
    assert pp_recv["send:bwd"] == {"bytes": 1024, "calls": 1}
    assert pp_send["recv:bwd"] == {"bytes": 1024, "calls": 1}
    assert "recv:fwd" not in pp_send and "send:fwd" not in pp_recv


# -- half duplex: both directions share one budget (ResBM Table 3's link) -------------------------
@pytest.mark.parametrize("shared", [False, True])
def test_half_duplex_serialises_both_directions(tmp_path, shared: bool) -> None:
    n, mbps, lat = 250_000, 20.0, 10.0
    tx = n * 8 / (mbps * 1e6)  # 0.1 s
    full = LinkEmulator(LinkSpec(mbps, lat))
    assert [full.schedule_send(0, 1, n, now=NOW), full.schedule_send(1, 0, n, now=NOW)] == pytest.approx(
        [NOW + tx + lat / 1e3] * 2, abs=1e-9)
    if shared:  # two processes (stage 0 sends activations, stage 1 gradients) see one clock file
        a = LinkEmulator(LinkSpec(mbps, lat), duplex="half", shared_dir=tmp_path)
        b = LinkEmulator(LinkSpec(mbps, lat), duplex="half", shared_dir=tmp_path)
    else:
        a = b = LinkEmulator(LinkSpec(mbps, lat), duplex="half")
    first, second = a.schedule_send(0, 1, n, now=NOW), b.schedule_send(1, 0, n, now=NOW)
    assert [first, second] == pytest.approx([NOW + tx + lat / 1e3, NOW + 2 * tx + lat / 1e3], abs=1e-9)
    # another stage pair is another link
    assert b.schedule_send(1, 2, n, now=NOW) == pytest.approx(NOW + tx + lat / 1e3, abs=1e-9)
    # the paper's arithmetic: an uncompressed d = 4096 bf16 token needs 2 x 4096 x 16 bit per boundary
    # over the shared 80 Mbit/s, i.e. about 610 tokens/s (Table 3 measured 609)
    link = LinkEmulator(LinkSpec(80, 0), duplex="half")
    tokens = 1000
    done = max(link.schedule_send(0, 1, tokens * 4096 * 2, now=NOW),
               link.schedule_send(1, 0, tokens * 4096 * 2, now=NOW))
    assert tokens / (done - NOW) == pytest.approx(80e6 / (2 * 4096 * 16), rel=1e-9)


def test_from_config_half_duplex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-run-id")
    link = link_emulator_from_config(LinkConfig(enabled=True, bandwidth_mbps=80, duplex="half"))
    assert link.duplex == "half" and "run-test-run-id" in str(link.shared_dir)
    assert link_emulator_from_config(LinkConfig(enabled=True, bandwidth_mbps=80)).duplex == "full"
    with pytest.raises(ConfigError, match="parallelism.link.duplex"):
        from nanotron_ext.config.loader import from_dict

        from_dict(LinkConfig, {"enabled": True, "duplex": "simplex"}, "parallelism.link")
