"""The model clock's loss runs (nanotron_ext/bench/wan/losses.py): each system's cheapest equivalent layout trains
the same function as its real layout. Reference: the real trainer under torchrun in the system's real layout
(dp x tp x pp processes over gloo, link emulation off), whose per-step training losses the one-process cheap
layout (tp = 1, pp = 1 with the codec at the stage boundary, replicas simulated) must reproduce for the first
steps. Measured: bit-identical on every step for Megatron TP + DP all-reduce, ResBM and MAPL across pp = 2, and for
the three-tier job at tp = 1; at tp = 2 a SparseLoCo outer sync differs, because its 64 x 64 chunks tile each TP
rank's shard rather than the whole tensor, so top-k keeps other entries (three tiers: 4.2e-4 on a loss of 5.97 one
step after the first sync). Hence: every step before the first outer sync to 1e-6, the steps after it to 1e-3
relative (the step 3 of a wrong codec placement or replica is off by far more)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List

import pytest

from nanotron_ext.bench.wan import losses, systems
from nanotron_ext.bench.wan.runs import run_overrides

STEPS, EXACT, AFTER_SYNC = 3, 1e-6, 1e-3


def _args(steps: int = STEPS) -> argparse.Namespace:
    return argparse.Namespace(config=systems.BASE, tp_preset="nvlink", steps=steps, val_every=steps,
                              inner_steps=2, set=[])


def _corpus(small_corpus: Path) -> List[str]:
    from tests.conftest import SMALL_VOCAB

    return [f"data.prepared_dir={small_corpus}", f"tokenizer.path={small_corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]


def test_the_cheap_layout_is_one_process_with_the_codec_at_the_stage_boundary() -> None:
    run = losses.loss_runs(["three_tiers"], [1], _args())[0]
    assert (run.replicas, run.mode) == (2, "sparseloco")
    sets = dict(o.split("=", 1) for o in run.overrides)
    assert (sets["parallelism.dp"], sets["parallelism.tp"], sets["parallelism.pp"]) == ("1", "1", "1")
    assert sets["model.codec.boundaries"] == "[1]"  # 4 layers over 2 stages: layer 1 sends
    assert sets["parallelism.link.enabled"] == "false"
    dense = losses.loss_runs(["dense_3d"], [1], _args())[0]
    assert (dense.replicas, dense.mode) == (2, "dense")


def test_runs_whose_cheap_layouts_coincide_share_one_key_and_seeds_do_not() -> None:
    a = losses.loss_runs(["3d_sm_sparseloco", "3d_sparseloco"], [1, 2], _args())
    keys = {(r.system, r.seed): r.key() for r in a}
    assert keys[("3d_sm_sparseloco", 1)] != keys[("3d_sparseloco", 1)]  # a codec on replica 0 changes the math
    assert keys[("3d_sm_sparseloco", 1)] != keys[("3d_sm_sparseloco", 2)]
    renamed = losses.LossRun("other", 1, a[0].config_file, a[0].overrides + ("general.run=elsewhere",),
                             a[0].replicas, a[0].mode, a[0].val_every)
    assert renamed.key() == a[0].key()  # a run's name and folder do not change what it computes
    guarded = losses.LossRun("other", 1, a[0].config_file, a[0].overrides + ("general.step_guard=host",),
                             a[0].replicas, a[0].mode, a[0].val_every)
    assert guarded.key() == a[0].key()  # where the guard reads its verdict: the same losses (test_step_guard)
    for key in ("checkpoints.storage=per_host", "logging.rank_cpu_seconds=true"):  # where shards go, what is logged
        other = losses.LossRun("other", 1, a[0].config_file, a[0].overrides + (key,), a[0].replicas, a[0].mode,
                               a[0].val_every)
        assert other.key() == a[0].key(), key
    # a default set in code as 4 and later as 4.0 (ResBM's ratio did) is one value: one key
    assert losses.digest({"ratio": 4, "lr": [1.0, 0.5]}, 12) == losses.digest({"ratio": 4.0, "lr": [1, 0.5]}, 12)
    assert losses.digest({"ratio": 4}, 12) != losses.digest({"ratio": 4.5}, 12)


@pytest.mark.slow
@pytest.mark.parametrize("system", ["three_tiers", "dense_3d", "resbm_pipeline", "mapl_pipeline"])
def test_the_cheap_layout_reproduces_the_real_layouts_first_losses(system: str, tmp_path: Path,
                                                                    small_corpus: Path) -> None:
    """three_tiers: BTP at tp = 2, the subspace codec on replica 0's stage link, heterogeneous SparseLoCo with an
    outer sync at step 2; dense_3d: Megatron TP, DP all-reduce; ResBM and MAPL: their codec across pp = 2."""
    from nanotron_ext.bench.training import run_training
    from nanotron_ext.metrics.logger import read_metrics

    args = _args()
    args.set = _corpus(small_corpus)
    config = str(systems.system_config(system, args))
    real_sets = [*run_overrides(system, None, 1, args), "parallelism.link.enabled=false"]
    summary = run_training(config, real_sets, f"real_{system}", nproc=systems.SYSTEMS[system].nproc,
                           root=tmp_path, timeout_s=600)
    real = [r["loss"] for r in read_metrics(Path(summary["run_dir"]) / "metrics.jsonl") if "loss" in r]
    [run] = losses.loss_runs([system], [1], args)
    cheap = losses.train(run, tmp_path / "cheap.json")
    assert len(real) == len(cheap["train_loss"]) == STEPS
    synced = run.mode == "sparseloco"  # H = 2: the loss of step 3 is the first after an outer sync
    before = STEPS - 1 if synced else STEPS
    assert cheap["train_loss"][:before] == pytest.approx(real[:before], abs=EXACT)
    assert cheap["train_loss"][before:] == pytest.approx(real[before:], rel=AFTER_SYNC)
    assert json.loads((tmp_path / "cheap.json").read_text())["key"] == run.key()
