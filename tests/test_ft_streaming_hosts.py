"""ft_streaming_hosts, tiny and functional (no timing bound: the machine running the suite is shared): the model
clock's bounds it reports against closed forms (no hosts needed), and the heal run end to end on two
network-namespace hosts: host 1 killed while a sync is in flight and relaunched, healed from replica 0, both go on,
their global weights equal at every outer sync from the heal on. Namespaces need root (as CI has): skipped
otherwise."""
from __future__ import annotations

import json
import math

import pytest

from nanotron_ext.bench.netns_hosts import available
from nanotron_ext.config.loader import load_config
from nanotron_ext.models.param_count import param_shapes
from nanotron_ext.sparseloco import ft_streaming_hosts
from nanotron_ext.sparseloco.accounting import outer_sync_bytes
from tests.conftest import SMALL_VOCAB

H, TAU, MBPS, TOPK = 4, 3, 4.0, 512
# replica 0 must still be training when host 1's replica is back (a fresh process: seconds, about 200 steps of this
# tiny model under load), so the heal run is long in steps
HEAL_STEPS = 300
TINY = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_size=192", "model.num_heads=2",
        "model.num_kv_heads=1", "tokens.sequence_length=64", "tokens.micro_batch_size=2",
        "tokens.batch_accumulation_per_replica=1", "tokens.val_steps=1"]


def _data(corpus) -> list:
    return [f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]


@pytest.mark.parametrize("tau", [0, TAU])
def test_the_clock_bounds_are_the_closed_forms(tmp_path, small_corpus, tau):
    sets = ft_streaming_hosts.job_sets("http://127.0.0.1:29510", tmp_path, 8, H, tau, TOPK, 2, 0,
                                       [*TINY, *_data(small_corpus)])
    cpu = [0.05, 0.07]  # CPU seconds per step of the twin's two ranks
    c = ft_streaming_hosts.clock_bounds(sets, cpu, MBPS, tmp_path / "plans")
    cfg = load_config(str(ft_streaming_hosts.EXAMPLE), sets)
    payload = outer_sync_bytes(param_shapes(cfg), cfg.sparseloco)  # one replica's, float math
    sync = payload * 8 / (MBPS * 1e6)  # a 2-replica all_gather: each host's link carries the other's payload
    assert c["outer_sync_s"] == pytest.approx(sync, rel=1e-3)
    assert c["outer_every"] == H and c["outer_overlap"] == tau
    compute = c["compute_step_s"]
    assert compute == pytest.approx(sum(cpu) / 2, rel=1e-6)  # equal replicas: one throughput, the job's flops over
    # the ranks' CPU seconds
    behind = H if tau == 0 else tau
    assert c["full_overlap_s"] == pytest.approx(compute + max(0.0, sync - behind * compute) / H, rel=1e-3)
    # the no-overlap bound: the sync stops the replicas every H steps (plus the twin's per-step loss agreement, a
    # few bytes over the link, which separate jobs do not have)
    assert c["no_overlap_s"] == pytest.approx(compute + sync / H, rel=1e-3, abs=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_replica_killed_with_a_sync_in_flight_heals_and_both_go_on(tmp_path, small_corpus):
    out = tmp_path / "result.json"
    argv = ["--mbps", str(MBPS), "--inner-steps", str(H), "--delay", str(TAU), "--topk", str(TOPK),
            "--heal-steps", str(HEAL_STEPS), "--runs", "heal", "--work", str(tmp_path / "work"), "--out", str(out),
            "--timeout-s", "400", *[x for s in [*TINY, *_data(small_corpus)] for x in ("--set", s)]]
    assert ft_streaming_hosts.main(argv) == 0
    result = json.loads(out.read_text())
    assert {"date", "machine", "commit", "loadavg_1m", "command"} <= set(result["meta"])
    assert "Heal (tau = 3)" in out.with_suffix(".md").read_text()
    heal = result["runs"]["heal"]
    killed = heal["killed_at_step"]["replica_1"]
    assert 0 < killed % H < TAU  # a sync in flight: sent at a multiple of H, arriving at + tau
    assert heal["resumed"] and "resumed from" in heal["resumed"][0]
    assert heal["healed"] and ft_streaming_hosts.HEALED in heal["healed"][0]
    r0, r1 = heal["replicas"]["0"], heal["replicas"]["1"]
    assert r0["steps"] == r1["steps"] == HEAL_STEPS  # both went on to the end
    # replica 0 trained on alone while host 1 was down, then synced with it again
    alone = [s for s in r0["membership"]["alone"] if s > heal["killed_at_step"]["replica_0"]]
    assert alone and any(s > alone[0] for s in r0["membership"]["with_peer"])
    assert r1["membership"]["with_peer"]
    g = heal["global_weights"]
    assert len(g["syncs_compared"]) >= 3 and g["all_equal"], g
    assert all(math.isfinite(x) for row in (r0, r1) for x in row["losses"])
