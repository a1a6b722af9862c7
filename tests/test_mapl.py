"""MAPL against independent references:

- PolarExpress equals U p(S) V^T with p the scalar composition of its published quintics (float64
  SVD of the input), and is as close to U V^T as those polynomials promise on the input's spectrum;
  with more than the five published steps it converges to the SVD polar factor U V^T;
- the Riemannian gradient is tangent (A^T g + g^T A = 0); SPEL keeps A^T A = I to 1e-5 over 100
  steps and decreases an objective; the anchor basis has orthonormal rows;
- the MAPL codec at PP=2 (both engines) and TP=2 x PP=2 gives the loss and every gradient of a
  single-process float64 model that applies X' = (X - a) A A^T + a at the boundary (shared copies'
  gradients summed), with wire bytes mbs * seq * (r * 4 + 4) per direction and the copies' gradient
  exchange: d r * 4 forward and (d r + U m) * 4 backward (U distinct ids of the step) by default,
  (d r + V m) * 4 each way with shared_sync: dense;
- over optimiser steps at PP=2 (fp32 and bf16) both copies of A and the anchor table stay bit-identical.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import micro_batches, one_step, small_config
from tests.helpers.references import scalar_map
from tests.test_parallel_parity import MB, MODEL, N_MICRO, SEQ, _global_batch

R, M = 8, 4


def test_polar_express_is_the_scalar_polynomial_on_the_singular_values() -> None:
    from nanotron_ext.optim.polar_express import EPS, SAFETY, polar_express

    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    expected = u @ torch.diag(scalar_map(s / (SAFETY * x.norm() + EPS))) @ vh
    torch.testing.assert_close(polar_express(x), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(polar_express(x.T), expected.T, rtol=1e-10, atol=1e-10)  # tall input
    # as close to the polar factor as the polynomials promise on this spectrum (spectral norm)
    promised = (scalar_map(s / (SAFETY * x.norm() + EPS)) - 1).abs().max()
    err = torch.linalg.matrix_norm(polar_express(x) - u @ vh, ord=2)
    assert err <= promised + 1e-10 and promised < 0.35


@pytest.mark.parametrize("steps", [8, 12, 20])
def test_polar_express_beyond_the_published_steps_converges_to_the_svd_polar_factor(steps: int) -> None:
    """More steps than the five published ones must approach U V^T (torch.linalg.svd), not the last published
    polynomial's fixed point (~1.035 U V^T): float64, a well- and an ill-conditioned input; fp32 to its precision."""
    from nanotron_ext.optim.polar_express import polar_express

    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(24, 40, generator=gen, dtype=torch.float64),  # condition ~7
              torch.randn(64, 64, generator=gen, dtype=torch.float64)):  # condition ~1300
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        err = torch.linalg.matrix_norm(polar_express(x, steps=steps) - u @ vh, ord=2).item()
        assert err <= (1e-10 if steps >= 12 or s[0] / s[-1] < 100 else 0.2), (steps, err)
    err32 = torch.linalg.matrix_norm(polar_express(x.float(), steps=steps).double() - u @ vh, ord=2).item()
    assert err32 <= (1e-4 if steps >= 12 else 0.2), err32
    assert scalar_map(torch.tensor(1.0, dtype=torch.float64), steps).item() == pytest.approx(1.0, abs=1e-12)


def test_riemannian_gradient_is_tangent_and_spel_stays_on_the_manifold() -> None:
    from nanotron_ext.mapl.spel import SPEL, riemannian_gradient

    g = torch.Generator().manual_seed(1)
    a = torch.linalg.qr(torch.randn(32, 8, generator=g))[0]
    grad = torch.randn(32, 8, generator=g)
    xi = riemannian_gradient(a, grad)
    skew = a.T @ xi + xi.T @ a
    assert skew.abs().max() < 1e-5
    # SPEL on f(A) = -tr(A^T C A) (top-8 eigenspace of a PSD C): objective falls, A stays orthonormal
    c = torch.randn(32, 32, generator=g)
    c = c @ c.T
    p = torch.nn.Parameter(a.clone())
    opt = SPEL([p], lr=0.05, momentum=0.9)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = -torch.trace(p.T @ c @ p)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    err = (p.detach().T @ p.detach() - torch.eye(8)).abs().max().item()
    assert err <= 1e-5, err
    assert losses[-1] < losses[0] - 1.0
    top = torch.linalg.eigvalsh(c)[-8:].sum()
    assert -losses[-1] <= top.item() * (1 + 1e-4)  # cannot beat the optimum


def test_anchor_basis_has_orthonormal_rows_and_both_sides_start_identical() -> None:
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import ModelConfig
    from nanotron_ext.mapl.codec import BoundaryProjection

    cfg = from_dict(ModelConfig, {**MODEL, "codec": {"kind": "mapl", "mapl": {"rank": R, "anchor_width": M}}})
    one, two = BoundaryProjection(cfg, 2), BoundaryProjection(cfg, 2)
    one.init_own_parameters_(7)
    two.init_own_parameters_(7)
    p = one.anchor_basis
    torch.testing.assert_close(p @ p.T, torch.eye(M), atol=1e-6, rtol=0)
    torch.testing.assert_close(one.A.T @ one.A, torch.eye(R), atol=1e-6, rtol=0)
    assert all(torch.equal(x, y) for x, y in zip(one.state_dict().values(), two.state_dict().values()))


def _anchor_values(boundary: int) -> torch.Tensor:
    return 0.1 * torch.randn(MODEL["vocab_size"], M, generator=torch.Generator().manual_seed(100 + boundary))


def _mapl_worker(tp: int, pp: int, engine: str, sync: str = "rows") -> dict:
    import nanotron.distributed as dist

    from nanotron_ext.mapl.codec import BoundaryProjection
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from tests.helpers.compare import worst_grad_error
    from tests.reference_llama import reference_loss, reference_params

    ctx = build_parallel_context(dp=1, tp=tp, pp=pp, backend="gloo")
    cfg = small_config({**MODEL, "codec": {"kind": "mapl", "boundaries": "stages",
                                           "mapl": {"rank": R, "anchor_width": M, "shared_sync": sync}}},
                       tp=tp, pp=pp, seq=SEQ, mb=MB, n_micro=N_MICRO, parallelism={"pp_engine": engine})
    model = build_model(cfg, ctx)
    copies = {n: m for n, m in model.named_modules() if isinstance(m, BoundaryProjection)}
    with torch.no_grad():
        for m in copies.values():
            m.anchor_table.copy_(_anchor_values(m.boundary))
    rows = _global_batch(1)
    loss, comm = one_step(model, micro_batches(rows, MB, N_MICRO), ctx, engine)

    # the float64 reference: one copy of each boundary's A and anchor table
    ref = reference_params(cfg.model, cfg.general.seed)
    boundary = 1  # stages=2 over 4 layers: layer 1 sends
    proj = BoundaryProjection(cfg.model, boundary)
    proj.init_own_parameters_(cfg.general.seed)
    a = proj.A.detach().double().requires_grad_()
    table = _anchor_values(boundary).double().requires_grad_()
    basis = proj.anchor_basis.double()

    def mapl(i: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if i != boundary:
            return x
        anchor = table[ids] @ basis
        return (x - anchor) @ a @ a.T + anchor

    ref_loss = reference_loss(cfg.model, ref, rows[:, :-1], rows[:, 1:], boundary=mapl)
    ref_loss.backward()
    for name in copies:
        ref[f"{name}.A"], ref[f"{name}.anchor_table"] = a, table
    worst, worst_name, names = worst_grad_error(model, ref)
    return {"loss": loss, "ref_loss": ref_loss.item(), "worst": worst, "worst_name": worst_name,
            "names": names, "comm": comm, "pp_rank": dist.get_rank(ctx.pp_pg)}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,engine,sync", [(1, 2, "1f1b", "rows"), (1, 2, "afab", "rows"), (2, 2, "1f1b", "rows"),
                                               (1, 2, "1f1b", "dense")])
def test_mapl_codec_matches_the_float64_reference(tp: int, pp: int, engine: str, sync: str) -> None:
    results = run_distributed(_mapl_worker, tp * pp, tp, pp, engine, sync)
    wire = MB * SEQ * (R * 4 + 4) // tp  # r fp32 columns + one int32 id column, per micro-batch, once over TP
    d, v = MODEL["hidden_size"], MODEL["vocab_size"]
    distinct = _global_batch(1)[:, :-1].unique().numel()  # U: the rows of the anchor table this step touched
    assert distinct < v
    values = {"fwd": d * R, "bwd": d * R + distinct * M} if sync == "rows" else {"fwd": d * R + v * M,
                                                                                 "bwd": d * R + v * M}
    exchange = {k: -(-n // tp) * 4 for k, n in values.items()}  # fp32, once over TP: each TP rank 1/tp (padded)
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"]
        assert r["worst"] <= 1e-5, (r["worst_name"], r["worst"])
        assert any(n.endswith(".A") for n in r["names"]) and any(n.endswith("anchor_table") for n in r["names"])
        pp_comm = r["comm"]["pp"]
        assert pp_comm.get("send:fwd", {}).get("bytes", 0) == (N_MICRO * wire if r["pp_rank"] == 0 else 0)
        assert pp_comm.get("send:bwd", {}).get("bytes", 0) == (N_MICRO * wire if r["pp_rank"] == 1 else 0)
        direction = "fwd" if r["pp_rank"] == 0 else "bwd"  # the sender's message goes forward
        assert {k: v["bytes"] for k, v in pp_comm.items() if k.startswith("send:codec_grads")} == \
            {f"send:codec_grads:{direction}": exchange[direction]}, pp_comm


def _copies_worker(dtype: str, steps: int) -> dict:
    """PP=2, the paper's hybrid optimiser (SPEL on A, AdamW on the anchor table): both copies after each step."""
    import nanotron.distributed as dist

    from nanotron_ext.mapl.codec import BoundaryProjection
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    cfg = small_config({**MODEL, "dtype": dtype, "codec": {"kind": "mapl", "mapl": {"rank": R, "anchor_width": M}}},
                       pp=2, seq=SEQ, mb=MB, n_micro=N_MICRO, optimizer={"name": "muon"})
    model = build_model(cfg, ctx)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    copy = next(m for m in model.modules() if isinstance(m, BoundaryProjection))
    micro = micro_batches(_global_batch(1), MB, N_MICRO)
    states = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            forward_backward(model, make_engine("1f1b"), micro, ctx)
        opt.step()
        opt.zero_grad()
        states.append({"A": copy.A.detach().clone(), "table": copy.anchor_table.detach().clone()})
    return {"pp_rank": dist.get_rank(ctx.pp_pg), "states": states}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_both_copies_stay_bit_identical_over_steps(dtype: str) -> None:
    sender, receiver = run_distributed(_copies_worker, 2, dtype, 3)
    for step, (a, b) in enumerate(zip(sender["states"], receiver["states"])):
        assert torch.equal(a["A"], b["A"]) and torch.equal(a["table"], b["table"]), step
        torch.testing.assert_close(a["A"].T @ a["A"], torch.eye(R), atol=1e-5, rtol=0)
    first, last = sender["states"][0], sender["states"][-1]
    assert not torch.equal(first["A"], last["A"]) and last["table"].abs().sum() > 0  # both trained


def test_muon_with_polar_express_takes_the_polar_express_step() -> None:
    """optimizer.muon_orthogonaliser: polar_express: one step equals the Muon formula written out here,
    with PolarExpress (bf16) in place of Newton-Schulz, and differs from the Newton-Schulz step."""
    from nanotron_ext.config.schema import OptimizerConfig
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.optim.polar_express import polar_express

    def one_step(orth: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False))
        cfg = OptimizerConfig(name="muon", muon_lr=0.02, weight_decay=0.1, muon_orthogonaliser=orth)
        opt = build_optimizer(model, cfg, None)
        model(torch.randn(4, 16)).square().sum().backward()
        w, g = model[0].weight.detach().clone(), model[0].weight.grad.clone()
        opt.step()
        if orth == "polar_express":  # momentum buffer starts at 0: buf = (1-mu) g; nesterov: g.lerp(buf, mu)
            mu = cfg.muon_momentum
            update = g.lerp((1 - mu) * g, mu)
            adjusted = 0.02 * math.sqrt(max(1.0, 24 / 16))  # torch's "original" shape adjustment
            expected = w * (1 - 0.02 * 0.1) - adjusted * polar_express(update, steps=5, dtype=torch.bfloat16)
            torch.testing.assert_close(model[0].weight.detach(), expected, rtol=1e-6, atol=1e-7)
        return model[0].weight.detach()

    assert not torch.equal(one_step("polar_express"), one_step("newton_schulz"))


def test_spel_modes_of_the_manifold_unaware_ablation() -> None:
    """optimizer.spel.mode: euclidean takes A - lr polar(g) (no tangent projection, no retraction) and
    leaves the manifold; euclidean_qr re-orthonormalises that step by QR; fixed never moves A; stiefel
    (SPEL) differs from both."""
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import OptimizerConfig
    from nanotron_ext.mapl.spel import SPEL, build_spel
    from nanotron_ext.optim.polar_express import polar_express

    g = torch.Generator().manual_seed(3)
    a0 = torch.linalg.qr(torch.randn(32, 8, generator=g, dtype=torch.float64))[0]
    c = torch.randn(32, 32, generator=g, dtype=torch.float64)
    c = c @ c.T

    def train(mode: str, steps: int) -> torch.Tensor:
        p = torch.nn.Parameter(a0.clone())
        opt = SPEL([p], lr=0.05, momentum=0.9, mode=mode)
        for _ in range(steps):
            opt.zero_grad()
            (-torch.trace(p.T @ c @ p)).backward()
            opt.step()
        return p.detach()

    grad = -2 * c @ a0  # d/dA of -tr(A^T C A); first momentum (1 - beta) g has the same polar factor
    torch.testing.assert_close(train("euclidean", 1), a0 - 0.05 * polar_express(grad, dtype=torch.float32),
                               rtol=0, atol=1e-6)
    eye = torch.eye(8, dtype=torch.float64)
    escaped = train("euclidean", 50)
    assert (escaped.T @ escaped - eye).abs().max() > 0.1  # manifold escape
    qr = train("euclidean_qr", 50)
    assert (qr.T @ qr - eye).abs().max() < 1e-10
    assert torch.equal(train("fixed", 20), a0)
    assert (train("stiefel", 1) - train("euclidean_qr", 1)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="mode"):
        SPEL([torch.nn.Parameter(a0.clone())], lr=0.1, mode="adam")
    opt = build_spel([torch.nn.Parameter(a0.clone())],
                     from_dict(OptimizerConfig, {"name": "muon", "spel": {"mode": "fixed"}}))
    assert opt.param_groups[0]["mode"] == "fixed"


def test_energy_and_principal_angles_match_closed_forms() -> None:
    from nanotron_ext.codecs.energy import energy_kept
    from nanotron_ext.mapl.analyse import analyse, principal_angles_deg

    e = torch.eye(6, dtype=torch.float64)
    x = torch.stack([3 * e[0] + 4 * e[1], 2 * e[0]])  # energy 25 + 4; inside span(e0): 9 + 4
    assert abs(energy_kept(x, e[:, :1]) - 13 / 29) < 1e-12
    assert abs(energy_kept(x, e[:, :2]) - 1.0) < 1e-12
    theta = 0.3
    a = e[:, :2]
    b = torch.stack([e[0], math.cos(theta) * e[1] + math.sin(theta) * e[2]], dim=1)
    angles = principal_angles_deg(a, b)
    torch.testing.assert_close(angles, torch.tensor([0.0, math.degrees(theta)], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    out = analyse({0: a, 3: b}, {0: x, 3: x})
    assert out["mean_principal_angle_deg"]["0-3"] == pytest.approx(math.degrees(theta) / 2, abs=1e-6)
    assert out["boundaries"][0]["energy_learned"] == pytest.approx(1.0)


def test_rank_for_energy_pair_cosine_pearson_and_stiefel_error_match_closed_forms() -> None:
    import numpy as np

    from nanotron_ext.mapl.analyse import pair_cosine_pearson, random_basis, rank_for_energy, stiefel_error

    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(50, 4, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(6, 4, generator=g, dtype=torch.float64))[0]
    x = u @ torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.1], dtype=torch.float64)) @ v.T
    # energies 9, 4, 1, 0.01 of 14.01: rank 2 keeps 92.8%, rank 3 99.93%
    assert rank_for_energy(x, 0.99) == 3 and rank_for_energy(x, 0.9) == 2 and rank_for_energy(x, 0.9999) == 4
    assert rank_for_energy(x, 9 / 14.01) == 1  # exactly at a boundary
    # a basis containing the rows' span keeps every cosine: r = 1; numpy's Pearson on a random basis
    assert pair_cosine_pearson(x, torch.eye(6, dtype=torch.float64)) == pytest.approx(1.0, abs=1e-12)
    assert pair_cosine_pearson(x, v) == pytest.approx(1.0, abs=1e-12)
    b = random_basis(6, 2, 0)
    gi = torch.Generator().manual_seed(9)
    i = torch.randint(0, 50, (4096,), generator=gi)
    j = (i + torch.randint(1, 50, (4096,), generator=gi)) % 50
    xn, zn = x.numpy(), (x @ b).numpy()

    def cos(m: np.ndarray) -> np.ndarray:
        return (m[i] * m[j]).sum(1) / np.linalg.norm(m[i], axis=1) / np.linalg.norm(m[j], axis=1)

    assert pair_cosine_pearson(x, b, seed=9) == pytest.approx(np.corrcoef(cos(xn), cos(zn))[0, 1], abs=1e-12)
    a = torch.linalg.qr(torch.randn(6, 3, generator=g, dtype=torch.float64))[0]
    assert stiefel_error(a) < 1e-12 and stiefel_error(2 * a) == pytest.approx(3.0)


def test_hybrid_optimiser_puts_anchor_tables_on_adamw_and_projections_on_spel() -> None:
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import ModelConfig, OptimizerConfig
    from nanotron_ext.mapl.codec import MaplEncoder
    from nanotron_ext.mapl.spel import SPEL
    from nanotron_ext.optim.build import build_optimizer

    cfg = from_dict(ModelConfig, {**MODEL, "codec": {"kind": "mapl", "mapl": {"rank": R, "anchor_width": M}}})
    enc = torch.nn.ModuleDict({"boundary_encoder": MaplEncoder(cfg, 1), "mlp": torch.nn.Linear(8, 8)})
    opt = build_optimizer(enc, OptimizerConfig(name="muon"), None)
    kinds = {id(p): type(o).__name__ for o in opt.optimizers for g in o.param_groups for p in g["params"]}
    proj = enc["boundary_encoder"].projection
    assert kinds[id(proj.A)] == SPEL.__name__
    assert kinds[id(proj.anchor_table)] == "AdamW"
    assert kinds[id(enc["mlp"].weight)] == "TensorParallelMuon"
