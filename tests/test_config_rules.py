"""Config keys that used to pass load and then crash, run out of memory or be ignored (issue 21 item 8,
issue 22, a bounded learning rate): each fails at load, in the section or technique that owns the key,
with one line naming the key and the value, and exit code 2 from the command line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_ext.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "config_tiny_llama.yaml"  # d = 128, 4 layers, pp = 1, dp = 2

CASES = {
    "low-rank wider than the model": (
        ["model.low_rank.kind=svd", "model.low_rank.rank=256"],
        "model.low_rank.rank: 256 exceeds model.hidden_size=128"),
    "MAPL anchor wider than the model": (
        ["model.codec.mapl.anchor_width=256"],
        "model.codec.mapl.anchor_width: 256 exceeds model.hidden_size=128"),
    "int4 with a width it cannot pack": (
        ["model.hidden_size=132", "model.num_heads=2", "model.num_kv_heads=2", "model.codec.kind=int4",
         "model.codec.boundaries=every_layer"],
        "model.hidden_size: 132 with model.codec.kind='int4': the codec packs 8 codes per 32-bit slot"),
    "a link from a stage to itself": (
        ["parallelism.pp=2", "model.tie_embeddings=false",
         'parallelism.link.per_stage_pair={"1-1": {bandwidth_mbps: 80}}'],
        "parallelism.link.per_stage_pair.1-1: '1-1': a stage has no link to itself"),
    "a negative link pair": (
        ["parallelism.pp=2", "model.tie_embeddings=false",
         'parallelism.link.per_stage_pair={"-1-0": {bandwidth_mbps: 80}}'],
        "parallelism.link.per_stage_pair.-1-0: '-1-0': keys look like '0-1'"),
    "a link pair that never carries a message": (
        ["parallelism.pp=3", "model.tie_embeddings=false",
         'parallelism.link.per_stage_pair={"0-2": {bandwidth_mbps: 80}}'],
        "parallelism.link.per_stage_pair.0-2: '0-2': pipeline messages only cross neighbouring stages"),
    "a link pair beyond the stages": (
        ["parallelism.pp=2", "model.tie_embeddings=false",
         'parallelism.link.per_stage_pair={"5-6": {bandwidth_mbps: 80}}'],
        "parallelism.link.per_stage_pair.5-6: names stage 6, but parallelism.pp=2 has stages 0..1"),
    "sparseloco keys the per-step all-reduce ignores": (
        ["sparseloco.inner_steps=10", "sparseloco.topk=8"],
        "sparseloco.inner_steps: 10 is set (also set: topk), but parallelism.dp_sync='allreduce' ignores"),
    "an infinite outer learning rate": (
        ["parallelism.dp_sync=sparseloco", "sparseloco.outer_lr=.inf"],
        "sparseloco.outer_lr: must be a finite number, got inf"),
    "a ResBM codec larger than the machine": (
        ["model.codec.kind=resbm", "model.codec.boundaries=every_layer", "model.codec.resbm.ratio=4",
         "model.codec.resbm.m=100000000"],
        "model.codec.resbm.m: 100000000 gives the ResBM codec 96,000,000,000 parameters (3 boundaries x 2 m (d + h))"),
    "a codec with no boundary to compress": (
        ["model.codec.kind=resbm"],
        "model.codec.kind: 'resbm' has no boundary to compress: model.codec.boundaries='stages' with parallelism.pp=1"),
    "compressed replicas with no boundary": (
        ["parallelism.dp_sync=sparseloco", "model.tie_embeddings=false", "sparseloco.compressed_replicas=[0]"],
        "sparseloco.compressed_replicas: [0] compress nothing"),
    "churn with no replica to go on with": (
        ["parallelism.dp_sync=sparseloco", "parallelism.dp=1", "sparseloco.churn.down_syncs=1"],
        "sparseloco.churn.down_syncs: 1: emulated churn drops one of the replicas from some syncs; parallelism.dp=1"),
    "churn longer than its period": (
        ["parallelism.dp_sync=sparseloco", "sparseloco.churn.down_syncs=6"],
        "sparseloco.churn.down_syncs: must be in [0, sparseloco.churn.period=5], got 6"),
    "emulated churn beside the real one": (
        ["parallelism.dp_sync=sparseloco", "parallelism.dp=1", "sparseloco.fault_tolerance.enabled=true",
         "sparseloco.churn.down_syncs=1"],
        "sparseloco.churn.down_syncs: 1: emulated churn is for one job; with sparseloco.fault_tolerance.enabled"),
    "an output constraint on a strategy with no output weight": (  # was NotImplementedError on every rank at build
        ["model.low_rank.kind=svd", "model.codec.kind=subspace", "parallelism.pp=2", "model.tie_embeddings=false"],
        "model.output_constraint.kind: 'subspace' cannot run with model.tp_strategy='vanilla'"),
    "a learning rate no optimiser survives": (
        ["optimizer.lr=1e30"],
        "optimizer.lr: must be in (0, 10] (a peak learning rate, e.g. 3e-4), got 1e+30"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fails_at_load_naming_key_and_value(case: str) -> None:
    overrides, message = CASES[case]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_command_line_prints_one_line_and_exits_2() -> None:
    for case in ("a ResBM codec larger than the machine", "a link pair beyond the stages"):
        overrides, message = CASES[case]
        out = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "show", "--config-file", str(TINY),
                              *[a for kv in overrides for a in ("--set", kv)]],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_the_resbm_bound_is_a_memory_estimate_not_a_cap_on_m() -> None:
    """A large but affordable m loads; the message names the estimate and the machine's memory."""
    cfg = load_config(TINY,
                      ["model.codec.kind=resbm", "model.codec.boundaries=every_layer", "model.codec.resbm.ratio=4",
                             "model.codec.resbm.m=100000"])
    assert cfg.model.codec.resbm.m == 100000
    with pytest.raises(ConfigError, match=r"about 1430\.5 GiB as fp32 weights, gradients and AdamW state \(16 bytes "
                                          r"each\), more than this machine's"):
        load_config(TINY, CASES["a ResBM codec larger than the machine"][0])


def test_what_still_loads() -> None:
    """The rules do not catch the settings the repository relies on: the codec placed inside one stage at
    pp = 1, the sparseloco section dropped for a dense baseline, links between neighbours; each keeps its values."""
    one = load_config(TINY, ["model.codec.kind=resbm", "model.codec.boundaries=every_layer"])
    assert (one.model.codec.kind, one.model.codec.boundaries, one.parallelism.pp) == ("resbm", "every_layer", 1)
    dense = load_config(REPO / "examples" / "config_tiny_sparseloco.yaml", ["parallelism.dp_sync=allreduce",
                                                                            "sparseloco=null"])
    assert dense.parallelism.dp_sync == "allreduce" and dense.sparseloco.inner_steps == 50  # the file's 10 dropped
    het = load_config(REPO / "examples" / "config_tiny_het_sparseloco.yaml")
    assert (het.parallelism.dp_sync, het.parallelism.dp, het.sparseloco.compressed_replicas) == ("sparseloco", 2, [0])
    linked = load_config(TINY, ["parallelism.pp=2", "model.tie_embeddings=false",
                                'parallelism.link.per_stage_pair={"1-0": {latency_ms: 5}}', "optimizer.lr=10"])
    assert (linked.parallelism.pp, linked.optimizer.lr) == (2, 10.0)
    assert linked.parallelism.link.per_stage_pair == {"1-0": {"latency_ms": 5.0}}


def test_the_removed_boost_tp_strategy_key_is_refused_by_name() -> None:
    """One way to choose the TP layout: model.tp_strategy. The old alias model.boost.tp_strategy is an
    unknown key like any other (the loader's normal error names it)."""
    with pytest.raises(ConfigError, match=r"^model\.boost\.tp_strategy: unknown key"):
        load_config(TINY, ["model.low_rank.kind=cola", "model.boost.tp_strategy=btp"])
