"""Per-tier links: the TP / DP collectives' ring waits against the closed forms written out by hand here,
presets and overrides through the YAML loader, and a collective's wait on two gloo ranks (slow)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from nanotron_ext.config.loader import load_config
from nanotron_ext.config.schema import ConfigError, LinkConfig, TierLinkConfig
from nanotron_ext.parallel import link as link_mod
from nanotron_ext.parallel.link import LINK_PRESETS, CollectiveLinks, LinkSpec, ring_collective_s
from tests.helpers.dist import run_distributed


# -- closed forms, each written out as numbers (not through ring_collective_s's own table) -------------------
# all_reduce, p=4, 1 MB at 100 Mbit/s, 10 ms: 2*3/4 * 8e6 bit / 1e8 + 2*3 * 0.01 = 0.12 + 0.06
# reduce_scatter, same: 3/4 * 0.08 + 3 * 0.01 = 0.06 + 0.03
# all_gather of a 1 MB shard, p=4: 3 * 0.08 + 3 * 0.01 = 0.27
# broadcast, p=4: 0.08 + 3 * 0.01 = 0.11
# all_reduce, p=2, 250 kB at 20 Mbit/s, 30 ms: 1 * 0.1 + 2 * 0.03 = 0.16; half duplex: 0.2 + 0.06
@pytest.mark.parametrize("op,nbytes,p,mbps,lat,duplex,expected", [
    ("all_reduce", 10**6, 4, 100.0, 10.0, "full", 0.18),
    ("reduce_scatter", 10**6, 4, 100.0, 10.0, "full", 0.09),
    ("all_gather", 10**6, 4, 100.0, 10.0, "full", 0.27),
    ("broadcast", 10**6, 4, 100.0, 10.0, "full", 0.11),
    ("all_reduce", 250_000, 2, 20.0, 30.0, "full", 0.16),
    ("all_reduce", 250_000, 2, 20.0, 30.0, "half", 0.26),
    ("all_reduce:tagged", 250_000, 2, 20.0, 0.0, "full", 0.1),
    ("all_reduce", 250_000, 2, 0.0, 30.0, "full", 0.06),  # unlimited bandwidth: latency only
    ("all_reduce", 250_000, 1, 20.0, 30.0, "full", 0.0),  # one rank: nothing crosses a link
    ("send", 250_000, 2, 20.0, 30.0, "full", 0.0),  # point-to-point: the pipeline tier's business
])
def test_ring_wait_equals_closed_form(op: str, nbytes: int, p: int, mbps: float, lat: float, duplex: str,
                                      expected: float) -> None:
    assert ring_collective_s(op, nbytes, p, LinkSpec(mbps, lat), duplex) == pytest.approx(expected, abs=1e-12)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_hook_sleeps_the_tier_wait_and_counts_it() -> None:
    tp, dp = _Group(2), _Group(4)
    names = {id(tp): "tp", id(dp): "dp"}
    links = CollectiveLinks({"tp": (LinkSpec(0.0, 0.0), "full"), "dp": (LinkSpec(100.0, 10.0), "full")},
                            lambda g: names.get(id(g), "world"))
    assert "tp" not in links.tiers  # an ideal tier is not hooked at all
    assert links.wait_s("all_reduce", 10**6, tp) == (None, 0.0)
    assert links.wait_s("all_reduce", 10**6, _Group(4)) == (None, 0.0)  # world / other groups: not delayed
    before = link_mod.waited_seconds().get("dp", 0.0)
    t0 = time.perf_counter()
    links("all_reduce", 10**6, dp)
    slept = time.perf_counter() - t0
    assert 0.18 <= slept < 0.18 + 0.2
    assert link_mod.waited_seconds()["dp"] - before == pytest.approx(0.18, abs=1e-12)


# -- config: presets, overrides, old keys ---------------------------------------------------------------
def _load(tmp_path: Path, text: str) -> LinkConfig:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path).parallelism.link


def test_presets_fill_unset_keys_and_keys_override(tmp_path: Path) -> None:
    link = _load(tmp_path, """
parallelism:
  link:
    enabled: true
    preset: internet-200m-50ms
    tp: {preset: nvlink}
    dp: {preset: internet-80m, latency_ms: 25}
""")
    assert (link.bandwidth_mbps, link.latency_ms, link.duplex) == (200.0, 50.0, "full")
    assert isinstance(link.tp, TierLinkConfig)
    assert (link.tp.bandwidth_mbps, link.tp.latency_ms, link.tp.duplex) == (3.6e6, 0.002, "full")
    assert (link.dp.bandwidth_mbps, link.dp.latency_ms, link.dp.duplex) == (80.0, 25.0, "half")


def test_old_keys_keep_working_and_tiers_default_to_ideal(tmp_path: Path) -> None:
    link = _load(tmp_path, "parallelism:\n  link: {enabled: true, bandwidth_mbps: 80, duplex: half}\n")
    assert (link.bandwidth_mbps, link.latency_ms, link.duplex) == (80.0, 0.0, "half")
    assert (link.dp.bandwidth_mbps, link.dp.latency_ms, link.dp.duplex) == (0.0, 0.0, "full")
    assert LinkConfig().bandwidth_mbps == 0.0 and LinkConfig().duplex == "full"


@pytest.mark.parametrize("text,key", [
    ("parallelism:\n  link: {preset: dialup}\n", "parallelism.link.preset"),
    ("parallelism:\n  link: {dp: {preset: dialup}}\n", "parallelism.link.dp.preset"),
    ("parallelism:\n  link: {tp: {bandwidth_mbps: -1}}\n", "parallelism.link.tp.bandwidth_mbps"),
    ("parallelism:\n  link: {dp: {duplex: simplex}}\n", "parallelism.link.dp.duplex"),
])
def test_bad_tier_settings_fail_at_load_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _load(tmp_path, text)


def test_every_preset_names_its_source() -> None:
    expected = {"nvlink", "nvlink3", "infiniband", "slingshot11", "10gbe", "datacenter-wan-1g", "internet-200m-50ms",
                "internet-80m"}
    assert set(LINK_PRESETS) == expected
    assert all(len(p.source) > 20 for p in LINK_PRESETS.values())
    assert (LINK_PRESETS["internet-200m-50ms"].bandwidth_mbps,
            LINK_PRESETS["internet-200m-50ms"].latency_ms) == (200, 50)


# -- two gloo ranks: the group finishes together at max(arrival) + T, bytes still counted -----------------------
E2E_MBPS, E2E_LAT, E2E_BYTES, LATE_S = 20.0, 30.0, 250_000, 0.3


def _tier_worker(tier: str) -> dict:
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.link import install_collective_links, waited_seconds

    ctx = build_parallel_context(dp=2 if tier == "dp" else 1, tp=2 if tier == "tp" else 1, pp=1, backend="gloo")
    ledger = get_ledger()
    cfg = LinkConfig(enabled=True, **{tier: TierLinkConfig(bandwidth_mbps=E2E_MBPS, latency_ms=E2E_LAT)})
    install_collective_links(cfg, ledger.group_name)
    group = getattr(ctx, f"{tier}_pg")
    rank = dist.get_rank(group)
    x = torch.ones(E2E_BYTES // 4)
    dist.barrier(group)
    ledger.reset()
    out = {}
    for op in ("all_reduce", "all_gather"):
        dist.barrier(group)
        if rank == 1:
            time.sleep(LATE_S)
        enter = time.time()
        if op == "all_reduce":
            dist.all_reduce(x, group=group)
        else:
            dist.all_gather([torch.empty_like(x) for _ in range(2)], x, group=group)
        out[op] = (enter, time.time())
    out["waited"] = waited_seconds().get(tier, 0.0)
    out["ledger"] = ledger.snapshot()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["dp", "tp"])
def test_collective_waits_as_a_ring_on_every_rank(tier: str) -> None:
    r0, r1 = run_distributed(_tier_worker, 2, tier)
    closed = {"all_reduce": 2 * 1 / 2 * E2E_BYTES * 8 / (E2E_MBPS * 1e6) + 2 * 1 * E2E_LAT / 1e3,  # 0.16 s
              "all_gather": 1 * E2E_BYTES * 8 / (E2E_MBPS * 1e6) + 1 * E2E_LAT / 1e3}  # 0.13 s
    for op, t in closed.items():
        last_in = max(r0[op][0], r1[op][0])
        for r in (r0, r1):  # both ranks leave together, T after the last one arrived
            assert t - 1e-3 <= r[op][1] - last_in < t + 0.25, (op, r[op], last_in, t)
        assert r0[op][0] < r1[op][0] - LATE_S / 2  # rank 0 really came early, and still waited for rank 1
    # the same wait on every rank, exactly the closed forms' sum
    assert r0["waited"] == r1["waited"] == pytest.approx(sum(closed.values()), abs=1e-9)
    for r in (r0, r1):
        assert r["ledger"][tier]["all_reduce"] == {"bytes": E2E_BYTES, "calls": 1}
        assert r["ledger"][tier]["all_gather"] == {"bytes": E2E_BYTES, "calls": 1}


# -- the trainer logs the fraction of each step spent waiting on each tier --------------------------------------
@pytest.mark.slow
def test_trainer_logs_the_dp_tier_wait_fraction(small_corpus: Path, tmp_path: Path) -> None:
    from nanotron_ext.metrics.logger import read_metrics
    from tests.test_trainer import _small_overrides, _train_worker

    mbps = 8.0
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 3) + [
        "parallelism.link.enabled=true", f"parallelism.link.dp.bandwidth_mbps={mbps}", "logging.log_interval=1",
        "general.run=waits"]
    run_distributed(_train_worker, 2, overrides, None, 0)
    records = read_metrics(tmp_path / "waits" / "metrics.jsonl")
    assert len(records) == 3
    for r in records:
        # p = 2 ring all-reduce, no latency: every byte this rank hands to the dp group waits N * 8 / B
        expected_s = r["comm_bytes"]["dp"] / 2 * 8 / (mbps * 1e6)
        assert expected_s > 0.05
        waited_s = r["link_wait_fraction"]["dp"] * r["step_time_s"]
        assert waited_s == pytest.approx(expected_s, rel=0.15), (r["link_wait_fraction"], r["step_time_s"])
        assert r["link_wait_fraction"]["pp"] == r["link_wait_fraction"]["tp"] == 0.0
        assert len(r["rank_cpu_s"]) == 2 and min(r["rank_cpu_s"]) > 0  # each rank's CPU seconds: the compute check


# -- heterogeneous SparseLoCo's utilisation model prices the DP link as the emulated DP tier waits ------------------
@pytest.mark.parametrize("kind,nbytes,replicas,mbps,latency_ms", [
    ("all_gather", 123_456, 2, 100.0, 0.0), ("all_gather", 10**6, 8, 1000.0, 10.0),
    ("all_reduce", 7 * 10**6, 4, 80.0, 50.0), ("all_reduce", 10**5, 2, 1.0, 0.0),
])
def test_utilisation_model_and_emulated_dp_tier_agree(kind: str, nbytes: int, replicas: int, mbps: float,
                                                      latency_ms: float) -> None:
    from nanotron_ext.sparseloco.accounting import collective_time_s

    model = collective_time_s(nbytes, replicas, mbps * 1e6, kind, latency_ms / 1e3)
    assert ring_collective_s(kind, nbytes, replicas, LinkSpec(mbps, latency_ms)) == pytest.approx(model, rel=1e-12)


def test_a_saved_config_with_presets_reloads_equal(tmp_path: Path) -> None:
    """The run's saved config.yaml (resolved values beside the preset) loads back to the same config: a resume
    compares them (train/guard.py resume_conflict)."""
    from nanotron_ext.config.loader import config_to_dict

    path = tmp_path / "c.yaml"
    path.write_text("parallelism:\n  link: {enabled: true, preset: internet-80m, dp: {preset: 10gbe, latency_ms: 3}}\n")
    cfg = load_config(path)
    again = tmp_path / "again.yaml"
    import yaml

    again.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert config_to_dict(load_config(again)) == config_to_dict(cfg)
    assert load_config(again).parallelism.link.dp.latency_ms == 3.0
