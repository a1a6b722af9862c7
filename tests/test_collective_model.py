"""NCCL's collective cost model (nanotron_ext/parallel/link.py CollectiveModel, issue 54) against its closed form
written out as numbers, the presets' sources, and the clock's once-per-step update taken from a plan and its AdamW
twin (bench/clock pricing.with_update_flops)."""
from __future__ import annotations

import pytest

from nanotron_ext.bench.clock import Link, replica_works, with_update_flops
from nanotron_ext.parallel.link import COLLECTIVE_MODELS, CollectiveModel, collective_s


@pytest.mark.parametrize("op,p,steps,volume", [
    ("all_reduce", 4, 6, 1.5), ("reduce_scatter", 4, 3, 0.75), ("all_gather", 4, 3, 3.0), ("broadcast", 8, 7, 1.0),
    ("all_reduce:grad", 2, 2, 1.0)])
def test_a_collective_is_base_plus_steps_times_latency_plus_volume_at_the_bus_bandwidth(
        op: str, p: int, steps: int, volume: float) -> None:
    """T = 10 us + steps x 2 us + volume x N / (100 GB/s); volume: nccl-tests' busbw factors (all-reduce 2(p-1)/p,
    reduce-scatter (p-1)/p of the input, all-gather (p-1) x the shard, broadcast 1)."""
    model = CollectiveModel(100.0, 10.0, 2.0, "test")
    n = 4e6
    assert collective_s(op, n, p, model) == pytest.approx(10e-6 + steps * 2e-6 + volume * n / 100e9)


def test_a_group_of_one_or_a_point_to_point_costs_nothing() -> None:
    model = COLLECTIVE_MODELS["nvlink3"]
    assert collective_s("all_reduce", 1e6, 1, model) == 0.0
    assert collective_s("send:fwd", 1e6, 4, model) == 0.0


def test_small_messages_are_latency_bound_large_ones_bandwidth_bound() -> None:
    """A100 NVLink 3 (NCCL: 20 GB/s x 12 links, 8.4 us per call, 3.4 us per step), all-reduce on 4 GPUs: the
    effective bus bandwidth (volume / time) grows with the message towards 240 GB/s."""
    model = COLLECTIVE_MODELS["nvlink3"]
    busbw = [1.5 * n / collective_s("all_reduce", n, 4, model) / 1e9 for n in (2 ** 14, 2 ** 20, 2 ** 23, 2 ** 27)]
    assert busbw == sorted(busbw) and busbw[0] < 1.0 and 200 < busbw[-1] < 240


def test_every_model_names_its_source() -> None:
    for name, model in COLLECTIVE_MODELS.items():
        assert "tuning.cc" in model.source and len(model.source) > 60, name
    assert COLLECTIVE_MODELS["nvlink3"].bus_gbytes_s == 12 * 20.0  # SM80_NVLINK_BW x the A100's links


def _rank(flops: float) -> dict:
    return {"rank": 0, "flops": flops, "ledger": {}}


def _plan(flops: list) -> dict:
    return {"layout": {"dp": 1, "tp": 1, "pp": len(flops)}, "micro_batches": 4, "schedule": "afab",
            "outer_every": 0, "replica_of": {"0": 0}, "inner": [[_rank(f) for f in flops]], "outer": None}


def test_the_update_is_the_plan_less_its_twin_priced_once_at_its_own_rate() -> None:
    """Muon's plan 10 + 6 FLOPs a stage, its AdamW twin 10: the update is 6 FLOPs, priced once at the update rate
    (3 FLOP/s: 2 s), and the micro-batches keep 10 / 4 each at the device's 1 FLOP/s (forward 1/3, backward 2/3)."""
    plan = with_update_flops(_plan([16.0, 16.0]), _plan([10.0, 10.0]))
    work = replica_works(plan, {"tp": Link(0.0), "dp": Link(0.0)}, [Link(0.0)], 1.0, update_flops_per_s=3.0)[0]
    assert list(work.update_s) == pytest.approx([2.0, 2.0])
    assert work.stages[0].fwd_s + work.stages[0].bwd_s == pytest.approx(10.0 / 4)
    with pytest.raises(ValueError, match="twin"):
        with_update_flops(_plan([16.0]), _plan([10.0, 10.0]))
    with pytest.raises(ValueError, match="more than the plan"):
        with_update_flops(_plan([9.0, 16.0]), _plan([10.0, 10.0]))
