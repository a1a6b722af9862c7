"""The streaming outer sync with heterogeneous replicas (sparseloco.streaming + sparseloco.compressed_replicas) and with
emulated churn (sparseloco.churn): every replica's table T_S and its T_fixed after every step, in the simulated driver
and over a real dp = 2 gloo group, against a float64 simulation written here from the equations:

- plain streaming SparseLoCo ("Streaming DiLoCo", arXiv:2501.18512; error feedback, top-k per 64 x 64 tile, outer
  momentum) on the whole table T = T_fixed + T_S: sent at every multiple t of H, applied tau steps later from the
  global weights, merged as theta = alpha theta + (1 - alpha) theta_global_new;
- heterogeneous SparseLoCo's embedding adaptation ("Heterogeneous Low-Bandwidth Pre-Training of LLMs", sec. 2.4):
  T_fixed starts as T - T U U^T and takes f = s U U^T - s at every applied outer step s, the same on every replica;
  each replica's T_S is its T minus T_fixed (T_fixed + T_S follows plain streaming SparseLoCo); a Grassmann update
  (U moved) re-splits the global T_S on the new U over every row;
- emulated churn: in sync c the replica (c // period) mod M is absent when c mod period < down_syncs; its payload is
  dropped (the mean is over the replicas present), its error feedback zeroed, and it rejoins at the send, healed with
  the global weights it was sent against; it trains the tau steps from them and merges on arrival as the others do.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.test_sparseloco_hetero import _Replica
from tests.test_sparseloco_streaming import _topk_tiles

H, STEPS, K, BETA, LR, MU = 3, 12, 32, 0.9, 0.8, 0.5  # sends at 3, 6, 9, 12; with tau = 2 arrivals at 5, 8, 11


def _config(delay: int, alpha: float, compressed: List[int], churn: Tuple[int, int] = (0, 5), grassmann: int = 0):
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config

    return from_dict(Config, {
        "parallelism": {"dp": 2, "dp_sync": "sparseloco"},
        "model": {"tie_embeddings": False, "codec": {"boundaries": "every_layer"}},
        "sparseloco": {"compressed_replicas": compressed, "topk": K, "beta": BETA, "outer_lr": LR,
                       "outer_momentum": MU, "value_dtype": "fp32", "inner_steps": H,
                       "churn": {"down_syncs": churn[0], "period": churn[1]}, "grassmann_every": grassmann,
                       "streaming": {"delay": delay, "alpha": alpha}}})


def _moves() -> List[List[torch.Tensor]]:
    """Per step, per replica: the inner step's change of its T_S (a stand-in for AdamW's)."""
    gen = torch.Generator().manual_seed(21)
    return [[torch.randn(64, 128, generator=gen) * 0.05 for _ in range(2)] for _ in range(STEPS)]


def _reference(start: torch.Tensor, basis: Optional[torch.Tensor], delay: int, alpha: float,
               churn: Tuple[int, int] = (0, 5),
               moved: Optional[torch.Tensor] = None) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per replica: (its whole table T = T_fixed + T_S, T_fixed), float64. `basis` None: no adaptation
    (T_fixed stays 0, T is the plain run's table). `moved`: U after a Grassmann update at the second outer step, where
    the global T_S is re-split on it: T_fixed += T_S - T_S U U^T over every row."""
    g = start.double()
    p = basis.double() @ basis.double().T if basis is not None else None
    fixed = g - g @ p if p is not None else torch.zeros_like(g)
    theta = [g.clone() for _ in range(2)]
    err = [torch.zeros_like(g) for _ in range(2)]
    mom = torch.zeros_like(g)
    syncs, pending, out = 0, None, []
    down, period = churn

    def absent() -> Optional[int]:
        return (syncs // period) % 2 if syncs % period < down else None

    def outer_step(mean: torch.Tensor) -> None:
        nonlocal g, fixed, mom, syncs, p
        mom = MU * mom + mean
        new = g - LR * mom
        if moved is not None and syncs + 1 == 2:
            p = moved.double() @ moved.double().T
            fixed = fixed + (new - fixed) - (new - fixed) @ p
        elif p is not None:
            s = g - new
            fixed = fixed + s @ p - s
        g, syncs = new, syncs + 1

    for step, moves in enumerate(_moves(), 1):
        theta = [t + m.double() for t, m in zip(theta, moves)]
        if delay and step % H == delay and pending is not None:
            outer_step(pending)
            pending = None
            theta = [alpha * t + (1 - alpha) * g for t in theta]
        if step % H == 0:
            sent = []
            for r in range(2):
                acc = BETA * err[r] + (g - theta[r])
                sent.append(_topk_tiles(acc, K))
                err[r] = acc - sent[-1]
            gone = absent()
            if gone is not None:
                err[gone] = torch.zeros_like(g)
                sent.pop(gone)
                theta[gone] = g.clone()  # healed at the send with the global weights (streaming)
            mean = sum(sent) / len(sent)
            if delay:
                pending = mean
            else:
                outer_step(mean)
                theta = [g.clone() for _ in range(2)]
        out.append([(t.clone(), fixed.clone()) for t in theta])
    return out


def _assert_matches(got: List[List[Tuple[torch.Tensor, torch.Tensor]]],
                    ref: List[List[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """`got`: per step, per replica, (T_S, T_fixed) of the implementation."""
    for step, (g_step, r_step) in enumerate(zip(got, ref), 1):
        for r, ((t_s, fixed), (table, want_fixed)) in enumerate(zip(g_step, r_step)):
            torch.testing.assert_close(fixed.double(), want_fixed, rtol=0, atol=1e-4, msg=f"T_fixed step {step} {r}")
            torch.testing.assert_close(t_s.double() + fixed.double(), table, rtol=0, atol=1e-4,
                                       msg=f"T_fixed + T_S, step {step}, replica {r}")


def _simulated(delay: int, alpha: float, churn: Tuple[int, int] = (0, 5), fold_local: bool = True,
               moved: Optional[torch.Tensor] = None, hetero_on: bool = True):
    """The in-process driver over two stand-in replicas (replica 0 compressed) with the hetero hook (`hetero_on`
    False: plain SparseLoCo on the table, T_fixed reported as 0). `moved`: a Grassmann update (grassmann_every = 2 H)
    that sets U to it (the stand-ins have no decoders to drive one)."""
    from nanotron_ext.sparseloco import hetero
    from nanotron_ext.sparseloco.hetero import hetero_hook
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter
    from nanotron_ext.sparseloco.simulate import SimulatedReplicas

    if moved is not None:
        def grassmann_update(hubs, move_weights: bool) -> bool:
            for hub in hubs:
                hub.basis.copy_(moved)
            return True

        hetero.grassmann_update = grassmann_update  # restored by the caller's monkeypatch
    cfg = _config(delay, alpha, [0] if hetero_on else [], churn, grassmann=2 * H if moved is not None else 0)
    models = {0: _Replica(True), 1: _Replica(False)}
    embs = [m.embedding for m in models.values()]
    sim = SimulatedReplicas(list(models.values()), cfg.sparseloco)
    start, basis = embs[0].table.weight.detach().clone(), None
    if hetero_on:
        hook = hetero_hook(cfg, models, syncs=lambda: sim.outer.syncs)
        start = (embs[0].table.weight + embs[0].hub.fixed).detach().clone()  # T, split in two
        basis = embs[0].hub.basis.clone()  # U at start
        if not fold_local:
            hook.keep = 0.0  # the control: the fold left out of each replica's own table
        sim.outer = SparseLoCoOuter(sim.params[0], cfg.sparseloco)  # the global copy after the split
        sim.hooks.append(hook)
    got, globals_ = [], []
    for step, moves in enumerate(_moves(), 1):
        with torch.no_grad():
            for emb, move in zip(embs, moves):
                emb.table.weight.add_(move)
        sim.after_step(step)
        got.append([(e.table.weight.detach().clone(), e.hub.fixed.clone() if hetero_on else torch.zeros(64, 128))
                    for e in embs])
        globals_.append(sim.outer.global_params[0].detach().clone())
    return start, basis, got, globals_


@pytest.mark.parametrize("delay,alpha,grassmann", [(2, 0.5, False), (1, 0.8, False), (0, 0.5, False),
                                                   (2, 0.5, True)])
def test_simulated_streaming_heterogeneous_equals_float64_reference(delay: int, alpha: float, grassmann: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from nanotron_ext.sparseloco import hetero

    monkeypatch.setattr(hetero, "grassmann_update", hetero.grassmann_update)
    moved = torch.linalg.qr(torch.randn(128, 16, generator=torch.Generator().manual_seed(5)))[0] if grassmann else None
    start, basis, got, globals_ = _simulated(delay, alpha, moved=moved)
    _assert_matches(got, _reference(start, basis, delay, alpha, moved=moved))
    for step, global_t_s in enumerate(globals_, 1):  # the global T_S is back in span(U) after every fold
        u = (moved if moved is not None and step >= 2 * H + delay else basis).double()  # U moved at the 2nd step
        assert (global_t_s.double() - global_t_s.double() @ u @ u.T).abs().max() < 1e-5, step
    for per_step in got:  # one T_fixed on every replica
        assert torch.equal(per_step[0][1], per_step[1][1])
    if delay:  # controls: the blocking reference, and the fold kept out of each replica's own T_S, must not match
        with pytest.raises(AssertionError):
            _assert_matches(got, _reference(start, basis, 0, alpha))
        with pytest.raises(AssertionError, match="T_fixed \\+ T_S"):
            _assert_matches(_simulated(delay, alpha, fold_local=False, moved=moved)[2],
                            _reference(start, basis, delay, alpha, moved=moved))


def _distributed_worker(delay: int, alpha: float, compressed: List[int], churn: Tuple[int, int]) -> dict:
    import torch.distributed as torch_dist

    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.pieces import SparseLoCoPieces

    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    rank = torch_dist.get_rank(ctx.dp_pg)
    model = _Replica(rank in compressed)
    emb = model.embedding
    sync = SparseLoCoPieces(None, ctx.tp_pg).dp_sync("sparseloco", model, ctx, _config(delay, alpha, compressed,
                                                                                        churn))
    start = emb.table.weight.detach().clone()  # plain SparseLoCo: the table is T, no T_fixed
    if compressed:  # T, split in two
        start += emb.hub.fixed
    out = {"kind": type(sync).__name__, "start": start, "basis": emb.hub.basis.clone(), "after": []}
    get_ledger().reset()
    for step, moves in enumerate(_moves(), 1):
        with torch.no_grad():
            emb.table.weight.add_(moves[rank])
        sync.after_step(step)
        fixed = emb.hub.fixed.clone() if compressed else torch.zeros(64, 128)
        out["after"].append((emb.table.weight.detach().clone(), fixed))
    sync.state_dict()  # waits for the sync still in flight
    out["bytes"], out["payload"] = get_ledger().bytes("dp", "all_gather"), sync.outer.payload_nbytes()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("churn", [(0, 5), (1, 2)])
def test_distributed_streaming_heterogeneous_equals_float64_reference(churn: Tuple[int, int]) -> None:
    """dp = 2 over gloo, replica 0 compressed, tau = 2, alpha = 0.5: StreamingSparseLoCoSync with the hetero hook;
    with churn (1, 2) replica 0 misses the sync sent at step 3, replica 1 the one sent at 9. The absent replica's
    slot still crosses: the ledger counts the bytes of the run without churn."""
    runs = run_distributed(_distributed_worker, 2, 2, 0.5, [0], churn)
    assert runs[0]["kind"] == "StreamingSparseLoCoSync"
    got = [[run["after"][s] for run in runs] for s in range(STEPS)]
    _assert_matches(got, _reference(runs[0]["start"], runs[0]["basis"], 2, 0.5, churn))
    assert all(run["bytes"] == STEPS // H * run["payload"] for run in runs)


def test_config_accepts_streaming_with_heterogeneous_replicas() -> None:
    from nanotron_ext.config.loader import load_config
    from tests.test_trainer import TINY

    cfg = load_config(TINY, ["parallelism.dp=2", "parallelism.dp_sync=sparseloco", "model.tie_embeddings=false",
                             "model.codec.boundaries=every_layer", "sparseloco.compressed_replicas=[0]",
                             "sparseloco.inner_steps=3", "sparseloco.streaming.delay=2"])
    cfg.validate()
    assert cfg.sparseloco.streaming.delay == 2


@pytest.mark.parametrize("delay,hetero_on", [(2, False), (2, True), (0, False)])
def test_simulated_streaming_with_churn_equals_float64_reference(delay: int, hetero_on: bool) -> None:
    """sparseloco.churn: replica 0 misses the sync sent at step 3, replica 1 the one sent at 9 (period 2)."""
    churn = (1, 2)
    start, basis, got, _ = _simulated(delay, 0.5, churn, hetero_on=hetero_on)
    _assert_matches(got, _reference(start, basis, delay, 0.5, churn))
    with pytest.raises(AssertionError):  # the control: the run without churn
        _assert_matches(got, _reference(start, basis, delay, 0.5))
