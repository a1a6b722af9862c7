"""reproduce/het_sparseloco/outer_jump.py's measure of an outer sync against closed forms: with every value sent
(k = chunk, fp32) the outer SGD step at outer lr a moves the global weights by a times the replicas' mean
progress, so `moved` is a (1: DiLoCo's averaging); top-k with k = 1 of 4096 moves them by less."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers.dist import run_distributed
from tests.test_trainer import TINY, _small_overrides


def _syncs_worker(overrides: list) -> List[Dict[str, float]]:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.loader import build_validation_loader
    from nanotron_ext.sparseloco.simulate import run_simulated
    from reproduce.het_sparseloco.outer_jump import jump_observer

    cfg = load_config(TINY, overrides)
    batches = list(itertools.islice(build_validation_loader(cfg, dp_rank=0, dp_size=1), 2))
    syncs: List[Dict[str, float]] = []
    run_simulated(cfg, 2, "sparseloco", observe=jump_observer(batches, syncs))
    return syncs


@pytest.mark.slow
@pytest.mark.parametrize("sent,outer_lr,moved", [("dense", 1.0, 1.0), ("dense", 2.0, 2.0), ("top1", 1.0, None)])
def test_moved_is_the_outer_lr_when_every_value_is_sent(small_corpus: Path, tmp_path: Path, sent: str,
                                                        outer_lr: float, moved: float) -> None:
    values = ["sparseloco.topk=4096", "sparseloco.value_dtype=fp32"] if sent == "dense" else ["sparseloco.topk=1"]
    overrides = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 4) + values + [
        "parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", f"sparseloco.outer_lr={outer_lr}",
        "sparseloco.embedding_adaptation=false"]
    syncs = run_distributed(_syncs_worker, 1, overrides)[0]
    assert len(syncs) == 2 and all({"before", "after", "moved"} <= set(s) for s in syncs), syncs
    for s in syncs:
        if moved is None:
            assert 0 < s["moved"] < 0.5, s
        else:
            assert s["moved"] == pytest.approx(moved, rel=1e-5), s
