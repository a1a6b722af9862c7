"""SparseLoCo through the trainer: dp = 2 trains and resumes bit-exactly from a checkpoint taken in the
middle of an inner loop (local weights != global weights, error buffers non-zero), so the outer state
must travel in the checkpoint; the in-process simulated runner gives the trainer's weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.test_trainer import _losses, _small_overrides, _train_worker

SPARSELOCO = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", "sparseloco.topk=8"]


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_sparseloco_resume_equals_uninterrupted(small_corpus: Path, tmp_path: Path, pp: int) -> None:
    """dp = 2 replicas of 1 or 2 pipeline stages (each stage syncs its own layers over its DP group)."""
    n, world = 3, 2 * pp  # the step-3 checkpoint falls between the syncs after steps 2 and 4
    straight = run_distributed(_train_worker, world, _small_overrides(small_corpus, tmp_path / "a", 2, 1, pp, 2 * n) + SPARSELOCO,
                               None, 0)
    resumed_ovr = _small_overrides(small_corpus, tmp_path / "b", 2, 1, pp, 2 * n) + SPARSELOCO
    run_distributed(_train_worker, world, resumed_ovr, n, n)
    resumed = run_distributed(_train_worker, world, resumed_ovr, None, n)
    a, b = _losses(tmp_path / "a" / "tiny_llama"), _losses(tmp_path / "b" / "tiny_llama")
    assert sorted(a) == sorted(b) == list(range(1, 2 * n + 1))
    for step in range(n + 1, 2 * n + 1):
        assert a[step] == b[step], (step, a[step], b[step])
    for rank, (wa, wb) in enumerate(zip(straight, resumed)):
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (rank, name)
    # after the last sync (step 6) every rank has a twin (same stage, other replica) with the same weights
    for r in range(world):
        twins = [q for q in range(world) if q != r and sorted(straight[q]) == sorted(straight[r])]
        assert any(all(torch.equal(straight[r][k], straight[q][k]) for k in straight[r]) for q in twins), r


@pytest.mark.slow
def test_sparseloco_resume_without_outer_state_differs(small_corpus: Path, tmp_path: Path) -> None:
    """The control: drop the outer state from the checkpoint and the resumed run no longer matches."""
    n = 3
    straight = run_distributed(_train_worker, 2, _small_overrides(small_corpus, tmp_path / "a", 2, 1, 1, 2 * n) + SPARSELOCO,
                               None, 0)
    ovr = _small_overrides(small_corpus, tmp_path / "b", 2, 1, 1, 2 * n) + SPARSELOCO
    run_distributed(_train_worker, 2, ovr, n, n)
    resumed = run_distributed(_forgetful_worker, 2, ovr, None, n)
    assert any(not torch.equal(straight[0][k], resumed[0][k]) for k in straight[0])


def _forgetful_worker(overrides: list, stop_after, interval: int) -> dict:
    from nanotron_ext.sparseloco.outer import SparseLoCoSync

    SparseLoCoSync.load_state_dict = lambda self, state: None  # keep the start-up outer state, ignore the checkpoint's
    return _train_worker(overrides, stop_after, interval)


def _simulated_worker(overrides: list, mode: str) -> dict:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.errors import TrainingError
    from nanotron_ext.sparseloco.simulate import run_simulated
    from tests.test_trainer import TINY

    try:
        out = run_simulated(load_config(TINY, overrides), 2, mode)
    except TrainingError as e:
        return {"error": str(e)}
    return {"weights": out["weights"], "train_loss": out["train_loss"], "val_loss": out["val_loss"]}


def _trainer_worker(overrides: list) -> dict:
    from nanotron_ext.errors import TrainingError

    try:
        return {"weights": _train_worker(overrides, None, 0)}
    except TrainingError as e:
        return {"error": str(e)}


@pytest.mark.slow
@pytest.mark.parametrize("mode,dtype", [("sparseloco", "fp32"), ("dense", "fp32"), ("sparseloco", "bf16")])
def test_simulated_runner_equals_the_trainer(small_corpus: Path, tmp_path: Path, mode: str, dtype: str) -> None:
    """run_simulated (M = 2 replicas in one process) takes the trainer's own step (nanotron_ext.train.replica):
    the trainer's dp = 2 losses (every step's train loss and the final validation loss) and weights bit for
    bit, for SparseLoCo and for classic DP (gradients averaged every step), and under bf16 autocast."""
    extra = (SPARSELOCO if mode == "sparseloco" else []) + [f"model.dtype={dtype}"]
    ovr = _small_overrides(small_corpus, tmp_path / "t", 2, 1, 1, 5) + extra
    trainer = run_distributed(_trainer_worker, 2, ovr)
    sim = run_distributed(_simulated_worker, 1, _small_overrides(small_corpus, tmp_path / "s", 2, 1, 1, 5) + extra, mode)[0]
    logged = _losses(tmp_path / "t" / "tiny_llama")
    assert sim["train_loss"] == [logged[step][0] for step in range(1, 6)]
    assert sim["val_loss"] == logged[5][1]
    for r in range(2):
        for name, w in trainer[r]["weights"].items():
            assert torch.equal(sim["weights"][r][name], w), (mode, r, name)
    if mode == "sparseloco":  # step 5 is an inner step: the replicas differ, so the equality is per replica
        assert any(not torch.equal(sim["weights"][0][k], sim["weights"][1][k]) for k in sim["weights"][0])


@pytest.mark.slow
def test_simulated_runner_and_trainer_stop_on_the_same_non_finite_step(small_corpus: Path, tmp_path: Path) -> None:
    """The non-finite guard is the trainer's in both: weights drawn with std 1e30 overflow the first backward;
    both stop before the first optimiser step with the same message (one config, so the same folders)."""
    ovr = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 3) + ["model.init_std=1e30"]
    trainer = run_distributed(_trainer_worker, 2, ovr)
    sim = run_distributed(_simulated_worker, 1, ovr, "dense")[0]
    assert trainer[0]["error"].startswith("step 1: the loss is ") and "the gradient norm nan (not finite)" in trainer[0]["error"]
    assert sim["error"] == trainer[0]["error"] == trainer[1]["error"]
