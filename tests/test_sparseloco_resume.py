"""SparseLoCo through the trainer: dp = 2 is SIGKILLed in the middle of an inner loop (local weights != global
weights, error buffers non-zero) and relaunched, and resumes bit-exactly, so the outer state travels in the
checkpoint; the distributed outer step (SparseLoCoSync over a gloo DP group) equals a reference written here
with explicit tile loops (not the package's own math); the in-process simulated runner gives the trainer's
weights."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.test_sparseloco_simulated import _sparsify_reference
from tests.test_trainer import _losses, _shard_models, _small_overrides, _train_worker, kill_and_resume

SPARSELOCO = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", "sparseloco.topk=8"]
SYNCS = 4  # outer steps of the distributed-vs-reference test


@pytest.mark.slow
@pytest.mark.timeout(600)  # three jobs of up to 4 processes: 45 s alone, 232-256 s beside another worker's test (CI)
@pytest.mark.parametrize("pp,kill", [(1, "worker"), (2, "launcher")])
def test_sparseloco_killed_mid_inner_loop_resumes_bit_exactly(small_corpus: Path, tmp_path: Path, pp: int,
                                                              kill: str) -> None:
    """dp = 2 replicas of 1 or 2 pipeline stages (each stage syncs its own layers over its DP group). Syncs
    every 4 steps, checkpoints every 3: every checkpoint before the end falls inside an inner loop."""
    steps = 12
    extra = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=4", "sparseloco.topk=8",
             "checkpoints.interval=3"]
    resumed_at = kill_and_resume(small_corpus, tmp_path, 2, 1, pp, kill, steps, extra)
    assert resumed_at % 4 != 0, resumed_at
    # after the last sync (step 12) the two replicas of each stage hold the same weights
    final = _shard_models(tmp_path / "b" / "ckpt" / f"step_{steps}")
    for stage in range(pp):
        a, b = final[f"pp{stage}_dp0_tp0.pt"], final[f"pp{stage}_dp1_tp0.pt"]
        assert all(torch.equal(a[k], b[k]) for k in a), stage


def _outer_step_worker(aggregate: str, down_syncs: int) -> dict:
    """Four SparseLoCo outer steps of a 128 x 64 linear over a real dp = 2 gloo group: each rank moves its replica
    by its own seeded amounts before each sync; returns what every replica held before and after each sync. With
    `down_syncs` = 1 (emulated churn, period 2) replica 0 misses sync 0 and replica 1 sync 2."""
    import torch.distributed as torch_dist

    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.config import ChurnConfig, SparseLoCoConfig
    from nanotron_ext.sparseloco.outer import SparseLoCoSync

    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    rank = torch_dist.get_rank(ctx.dp_pg)
    torch.manual_seed(rank)  # different starts: the sync must make them agree (rank 0's weights win)
    model = torch.nn.Linear(128, 64)
    cfg = SparseLoCoConfig(inner_steps=1, topk=32, beta=0.9, outer_lr=0.8, outer_momentum=0.5, aggregate=aggregate,
                           churn=ChurnConfig(down_syncs=down_syncs, period=2))
    sync = SparseLoCoSync(model, ctx, SimpleNamespace(sparseloco=cfg))
    out = {"start": [p.detach().clone() for p in model.parameters()], "local": [], "after": []}
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(SYNCS):
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(torch.randn(p.shape, generator=gen) * 0.01)
        out["local"].append([p.detach().clone() for p in model.parameters()])
        sync.sync()
        out["after"].append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("aggregate,down_syncs", [("all", 0), ("senders", 0), ("all", 1)])
def test_the_distributed_outer_step_equals_an_independent_reference(aggregate: str, down_syncs: int) -> None:
    """The trainer's DP sync (one all_gather of the encoded payloads, decoded on every rank) against the tile-loop
    reference of test_sparseloco_simulated: error feedback, top-k per 64 x 64 tile (runs of 4096 for 1-D), bf16
    values, mean over all replicas or over the senders of each position, outer SGD with momentum. Under emulated
    churn (sparseloco.churn) the absent replica sends nothing that counts and rejoins with zero error feedback."""
    runs = run_distributed(_outer_step_worker, 2, aggregate, down_syncs)
    beta, lr, mu = 0.9, 0.8, 0.5
    absent = {0: 0, 2: 1} if down_syncs else {}  # sync -> the replica that misses it (period 2, rotating)
    g = [t.clone() for t in runs[0]["start"]]  # rank 0's weights are everybody's global weights
    errors = [[torch.zeros_like(t) for t in g] for _ in runs]
    mom = [torch.zeros_like(t) for t in g]
    for sync in range(SYNCS):
        for i in range(len(g)):
            sent = []
            for r, run in enumerate(runs):
                acc = beta * errors[r][i] + (g[i] - run["local"][sync][i])
                if absent.get(sync) == r:  # gone since the last sync: its work and its error feedback are lost
                    errors[r][i] = torch.zeros_like(acc)
                    continue
                sent.append(_sparsify_reference(acc, 32))
                errors[r][i] = acc - sent[-1]
            total = sum(sent[1:], sent[0])
            mean = total / len(sent) if aggregate == "all" else total / sum((s != 0).float() for s in sent).clamp(min=1)
            mom[i] = mu * mom[i] + mean
            g[i] = g[i] - lr * mom[i]
        for r, run in enumerate(runs):
            for got, ref in zip(run["after"][sync], g):
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-6, msg=f"sync {sync}, rank {r}")
    assert not torch.equal(runs[0]["local"][0][0], runs[1]["local"][0][0])  # the replicas did differ before


@pytest.mark.slow
def test_sparseloco_resume_without_outer_state_differs(small_corpus: Path, tmp_path: Path) -> None:
    """The control: drop the outer state from the checkpoint and the resumed run no longer matches."""
    n = 3
    straight = run_distributed(_train_worker, 2,
                               _small_overrides(small_corpus, tmp_path / "a", 2, 1, 1, 2 * n) + SPARSELOCO,
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
    sim = run_distributed(_simulated_worker, 1,
                          _small_overrides(small_corpus, tmp_path / "s", 2, 1, 1, 5) + extra, mode)[0]
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
    assert trainer[0]["error"].startswith("step 1: the loss is "
                                          "") and "the gradient norm nan (not finite)" in trainer[0]["error"]
    assert sim["error"] == trainer[0]["error"] == trainer[1]["error"]
