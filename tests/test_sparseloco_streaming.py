"""The streaming outer sync (sparseloco.streaming; "Streaming DiLoCo with overlapping communication", arXiv:2501.18512):

- over a real dp = 2 gloo group (the all_gather on its side thread) and in the simulated driver, every replica's
  weights after every step equal a float64 simulation written here from the paper's equations: the outer gradient
  sent at step t (t a multiple of H) is applied at t + tau, from the global weights it was taken against, and each
  replica then merges theta = alpha theta_local + (1 - alpha) theta_global_new; the next outer gradient is taken
  against that theta_global_new. Top-k per 64 x 64 tile with error feedback (SparseLoCo) and every entry with outer
  Nesterov (dense DiLoCo); tau = 0 is the blocking sync (the same simulation with no delay and no merge);
- the ledger counts the same all_gather bytes and calls as the blocking sync;
- the collective overlaps: under a 400 ms emulated DP link the training thread spends almost nothing in the sync's
  send and arrival, while the blocking sync spends the 400 ms;
- through the trainer, a run checkpointed with the sync in flight and resumed logs the straight run's losses bit for
  bit.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.test_trainer import _losses, _small_overrides, _train_worker

H, STEPS = 3, 10  # sends at 3, 6, 9; with tau = 2 arrivals at 5, 8 (the one sent at 9 still in flight at the end)
SPARSE = dict(topk=32, value_dtype="fp32", beta=0.9, outer_lr=0.8, outer_momentum=0.5)
DILOCO = dict(topk=4096, value_dtype="fp32", beta=0.0, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)


def _cfg(algo: dict, delay: int, alpha: float = 0.5):
    from nanotron_ext.sparseloco.config import SparseLoCoConfig, StreamingConfig

    return SparseLoCoConfig(inner_steps=H, chunk=4096, **algo, streaming=StreamingConfig(delay=delay, alpha=alpha))


def _noise(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + rank)


def _inner_step(params, gen: torch.Generator) -> None:
    """A stand-in for an inner optimiser step: a seeded move of every weight."""
    with torch.no_grad():
        for p in params:
            p.sub_(torch.randn(p.shape, generator=gen) * 0.01)


def _distributed_worker(algo: dict, delay: int) -> dict:
    import torch.distributed as torch_dist

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.pieces import SparseLoCoPieces

    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    rank = torch_dist.get_rank(ctx.dp_pg)
    torch.manual_seed(rank)  # different starts: rank 0's are broadcast
    model = torch.nn.Linear(128, 64)
    pieces = SparseLoCoPieces(None, ctx.tp_pg)
    sync = pieces.dp_sync("sparseloco", model, ctx, SimpleNamespace(sparseloco=_cfg(algo, delay)))
    out: Dict[str, object] = {"kind": type(sync).__name__, "start": [p.detach().clone() for p in model.parameters()],
                              "after": []}
    get_ledger().reset()
    gen = _noise(rank)
    for step in range(1, STEPS + 1):
        _inner_step(model.parameters(), gen)
        sync.after_step(step)
        out["after"].append([p.detach().clone() for p in model.parameters()])
    sync.state_dict()  # waits for the sync still in flight
    out["bytes"], out["calls"] = get_ledger().bytes("dp", "all_gather"), get_ledger().calls("dp", "all_gather")
    out["payload"] = sync.outer.payload_nbytes()
    return out


def _simulated(algo: dict, delay: int) -> List[List[List[torch.Tensor]]]:
    """The in-process driver, the same moves: per step, per replica, its weights."""
    from nanotron_ext.sparseloco.simulate import SimulatedReplicas

    models = []
    for r in range(2):
        torch.manual_seed(r)
        models.append(torch.nn.Linear(128, 64))
    sim = SimulatedReplicas(models, _cfg(algo, delay))
    gens = [_noise(r) for r in range(2)]
    after = []
    for step in range(1, STEPS + 1):
        for m, gen in zip(models, gens):
            _inner_step(m.parameters(), gen)
        sim.after_step(step)
        after.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return after


def _topk_tiles(acc: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |acc| of every 64 x 64 tile (1-D: of every run of 4096), others zero."""
    out = torch.zeros_like(acc)
    if acc.dim() == 1:
        for s in range(0, acc.numel(), 4096):
            run = acc[s:s + 4096]
            idx = run.abs().topk(min(k, run.numel())).indices
            out[s:s + 4096][idx] = run[idx]
        return out
    for i in range(0, acc.shape[0], 64):
        for j in range(0, acc.shape[1], 64):
            tile = acc[i:i + 64, j:j + 64].reshape(-1)
            flat = torch.zeros_like(tile)
            idx = tile.abs().topk(min(k, tile.numel())).indices
            flat[idx] = tile[idx]
            out[i:i + 64, j:j + 64] = flat.reshape(64, 64)
    return out


def _reference(start: List[torch.Tensor], algo: dict, delay: int, alpha: float = 0.5) -> List[List[List[torch.Tensor]]]:
    """Streaming DiLoCo's delayed outer step in float64, two replicas, the same seeded moves."""
    g = [t.double() for t in start]
    theta = [[t.clone() for t in g] for _ in range(2)]
    err = [[torch.zeros_like(t) for t in g] for _ in range(2)]
    mom = [torch.zeros_like(t) for t in g]
    gens = [_noise(r) for r in range(2)]
    lr, mu, nesterov, beta, k = (algo["outer_lr"], algo["outer_momentum"], algo.get("outer_nesterov", False),
                                 algo["beta"], algo["topk"])
    pending = None
    after = []

    def outer_step(mean: List[torch.Tensor]) -> None:
        for i, a in enumerate(mean):
            mom[i] = mu * mom[i] + a
            g[i] = g[i] - lr * (a + mu * mom[i] if nesterov else mom[i])

    for step in range(1, STEPS + 1):
        for r in range(2):
            theta[r] = [t - torch.randn(t.shape, generator=gens[r]).double() * 0.01 for t in theta[r]]
        if delay and step % H == delay and pending is not None:
            outer_step(pending)
            pending = None
            theta = [[alpha * t + (1 - alpha) * gi for t, gi in zip(th, g)] for th in theta]
        if step % H == 0:
            sent = []
            for r in range(2):
                acc = [beta * e + (gi - t) for e, gi, t in zip(err[r], g, theta[r])]
                sent.append([_topk_tiles(a, k) for a in acc])
                err[r] = [a - s for a, s in zip(acc, sent[-1])]
            mean = [(s0 + s1) / 2 for s0, s1 in zip(*sent)]
            if delay:
                pending = mean
            else:
                outer_step(mean)
                theta = [[gi.clone() for gi in g] for _ in range(2)]
        after.append([[t.clone() for t in th] for th in theta])
    return after


def _assert_matches(got: List[List[List[torch.Tensor]]], ref: List[List[List[torch.Tensor]]]) -> None:
    for step, (g_step, r_step) in enumerate(zip(got, ref), 1):
        for r, (g_rep, r_rep) in enumerate(zip(g_step, r_step)):
            for a, b in zip(g_rep, r_rep):
                torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5, msg=f"step {step}, replica {r}")


CASES = [("sparseloco", SPARSE, 2), ("diloco", DILOCO, 2), ("sparseloco", SPARSE, 0), ("diloco", DILOCO, 1)]


@pytest.mark.parametrize("name,algo,delay", CASES[:3])
def test_simulated_streaming_equals_float64_reference(name: str, algo: dict, delay: int) -> None:
    got = _simulated(algo, delay)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in torch.nn.Linear(128, 64).parameters()]  # replica 0's, everyone's start
    _assert_matches(got, _reference(start, algo, delay))
    if delay:  # the control: the same run against the blocking simulation must not match
        with pytest.raises(AssertionError):
            _assert_matches(got, _reference(start, algo, 0))


@pytest.mark.slow
@pytest.mark.parametrize("name,algo,delay", CASES)
def test_distributed_streaming_equals_float64_reference_and_ledger(name: str, algo: dict, delay: int) -> None:
    runs = run_distributed(_distributed_worker, 2, algo, delay)
    assert runs[0]["kind"] == ("StreamingSparseLoCoSync" if delay else "SparseLoCoSync")
    got = [[run["after"][s] for run in runs] for s in range(STEPS)]
    _assert_matches(got, _reference(runs[0]["start"], algo, delay))
    sends = STEPS // H
    for run in runs:  # the blocking sync's payload, once per send, counted under dp
        assert (run["bytes"], run["calls"]) == (sends * run["payload"], sends), run


def _overlap_worker(delay: int) -> Dict[int, float]:
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.link import install_collective_links
    from nanotron_ext.sparseloco.pieces import SparseLoCoPieces

    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    tier = SimpleNamespace(bandwidth_mbps=0.0, latency_ms=0.0, duplex="full")
    install_collective_links(SimpleNamespace(enabled=True, tp=tier, dp=SimpleNamespace(**{**vars(tier),
                                                                                          "latency_ms": 400.0})),
                             get_ledger().group_name)  # an all_gather over 2 ranks: (p - 1) x 400 ms
    from nanotron_ext.sparseloco.config import SparseLoCoConfig, StreamingConfig

    model = torch.nn.Linear(128, 64)
    cfg = SparseLoCoConfig(inner_steps=4, topk=32, streaming=StreamingConfig(delay=delay))
    sync = SparseLoCoPieces(None, ctx.tp_pg).dp_sync("sparseloco", model, ctx, SimpleNamespace(sparseloco=cfg))
    spent = {}
    for step in range(1, 9):
        time.sleep(0.25)  # an inner step's compute
        t0 = time.perf_counter()
        sync.after_step(step)
        spent[step] = time.perf_counter() - t0
    sync.state_dict()
    return spent


@pytest.mark.slow
def test_streaming_sync_overlaps_the_emulated_link() -> None:
    blocking = run_distributed(_overlap_worker, 2, 0)
    streaming = run_distributed(_overlap_worker, 2, 3)
    for b, s in zip(blocking, streaming):
        assert b[4] >= 0.4 and b[8] >= 0.4, b  # the blocking sync waits for the link
        assert max(s[4], s[7], s[8]) < 0.2, s  # send returns at once; 3 x 250 ms later the payloads are there


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_with_the_sync_in_flight_is_bit_exact(small_corpus: Path, tmp_path: Path) -> None:
    """12 steps straight, against 6 (checkpoint at 6: the sync sent at 6 lands at 8), then a resumed 6."""
    extra = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=3", "sparseloco.topk=8",
             "sparseloco.streaming.delay=2"]
    a, b = tmp_path / "a", tmp_path / "b"
    straight = run_distributed(_train_worker, 2, _small_overrides(small_corpus, a, 2, 1, 1, 12) + extra, None, 0)
    ovr = _small_overrides(small_corpus, b, 2, 1, 1, 12) + extra
    run_distributed(_train_worker, 2, ovr, 6, 6)
    shard = torch.load(b / "ckpt" / "step_6" / "pp0_dp0_tp0.pt", map_location="cpu", weights_only=True)
    assert shard["extra"]["dp_sync"]["in_flight"] is not None  # the checkpoint did catch the sync in flight
    resumed = run_distributed(_train_worker, 2, ovr, None, 6)
    la, lb = _losses(a / "tiny_llama"), _losses(b / "tiny_llama")
    assert sorted(la) == sorted(lb) == list(range(1, 13))
    assert la == lb
    for k in straight[0]:
        assert torch.equal(straight[0][k], resumed[0][k]), k


def test_config_rules() -> None:
    from nanotron_ext.config.checks import ConfigError
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.sparseloco.outer import SparseLoCoSync

    with pytest.raises(ConfigError, match=r"sparseloco.streaming.delay: must be in \[0, sparseloco.inner_steps=3\)"):
        _cfg(SPARSE, 3)
    with pytest.raises(ConfigError, match="sparseloco.streaming.alpha"):
        _cfg(SPARSE, 1, alpha=1.5)
    example = Path(__file__).resolve().parent.parent / "examples" / "config_tiny_sparseloco.yaml"
    for extra in (["sparseloco.churn.down_syncs=1"], ["sparseloco.fault_tolerance.enabled=true", "parallelism.dp=1"]):
        assert load_config(example, ["sparseloco.streaming.delay=1", *extra]).sparseloco.streaming.delay == 1
    assert load_config(example, ["sparseloco.streaming.delay=1"]).sparseloco.streaming.alpha == 0.5
    with pytest.raises(ValueError, match="resume with the run's sparseloco.streaming.delay"):  # the blocking sync
        SparseLoCoSync.load_state_dict(object.__new__(SparseLoCoSync), {"global": {}, "in_flight": [torch.zeros(4)]})


def test_utilisation_with_the_sync_behind_delay_steps() -> None:
    """Closed form: 1 s steps, H = 10, an all_gather of 1 MB over 2 replicas at 2 Mbit/s = 4 s: blocking 10 / 14;
    behind 3 steps 1 s stalls (10 / 11); behind 5 steps none (1.0)."""
    from nanotron_ext.sparseloco.accounting import compute_utilisation

    args = (1.0, 10, 1e6, 2, 2e6)
    assert compute_utilisation(*args) == pytest.approx(10 / 14)
    assert compute_utilisation(*args, delay_steps=3) == pytest.approx(10 / 11)
    assert compute_utilisation(*args, delay_steps=5) == 1.0
