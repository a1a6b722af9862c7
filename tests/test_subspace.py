"""Subspace Models pieces on one process, each against a reference written here: the seeded basis, the
codec's exact round trip and its backward G U U^T, the sec. 5 modified AdamW (formula, span kept where
plain AdamW leaves it), the Grassmann step (U^T U = I, U^T xi = 0, autograd gradient, descent), and the
configuration errors."""
from __future__ import annotations

import pytest
import torch

from nanotron_ext.config.schema import ConfigError, ModelConfig


def _model_cfg(**sub) -> ModelConfig:
    from nanotron_ext.config.loader import from_dict

    return from_dict(ModelConfig, {"vocab_size": 50, "hidden_size": 16, "num_heads": 2, "num_kv_heads": 1,
                                   "embedding": {"kind": "subspace"}, "output_constraint": {"kind": "subspace"},
                                   "codec": {"kind": "subspace"}, "subspace": {"k": 4, **sub}})


def test_basis_is_an_orthonormal_qr_of_a_seeded_gaussian() -> None:
    from nanotron_ext.subspace import make_basis

    u = make_basis(32, 8, seed=5)
    torch.testing.assert_close(u.T @ u, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(u, make_basis(32, 8, seed=5))  # the same on every rank
    assert (u - make_basis(32, 8, seed=6)).abs().max() > 0.1
    gauss = torch.randn(32, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    q = torch.linalg.qr(gauss)[0]
    # the same span as the Gaussian's columns (a basis of it, whatever the sign convention)
    torch.testing.assert_close((u.double() @ u.double().T) @ q, q, atol=1e-6, rtol=0)


def test_codec_round_trip_is_exact_in_span_and_its_backward_is_g_u_ut() -> None:
    from nanotron_ext.subspace import hub_for
    from nanotron_ext.subspace.codec import SubspaceDecoder, SubspaceEncoder

    cfg = _model_cfg()
    hub = hub_for(cfg)
    u, fixed = hub.basis, hub.fixed
    ids = torch.randint(0, 50, (2, 5))
    coords = torch.randn(2, 5, 4)
    x = (fixed[ids] + coords @ u.T).requires_grad_()  # what a constrained stage writes
    wire = SubspaceEncoder(hub, torch.float32)(residual=x, branch=torch.zeros_like(x), input_ids=ids)
    assert wire.shape == (2, 5, 4)
    rebuilt, hidden = SubspaceDecoder(hub, 0, accumulate=False)(wire, ids)
    assert rebuilt is hidden
    torch.testing.assert_close(rebuilt, x, atol=1e-6, rtol=0)
    g = torch.randn(2, 5, 16)
    rebuilt.backward(g)
    torch.testing.assert_close(x.grad, g @ u @ u.T, atol=1e-6, rtol=0)
    # an out-of-span X is not rebuilt: exactness rests on the constraints
    off = fixed[ids] + torch.randn(2, 5, 16)
    back, _ = SubspaceDecoder(hub, 0, accumulate=False)(SubspaceEncoder(hub, torch.float32)(off, torch.zeros_like(off), ids), ids)
    assert (back - off).norm() / off.norm() > 0.1


def test_decoder_accumulates_the_gram_matrix_of_the_received_gradient() -> None:
    from nanotron_ext.subspace import hub_for
    from nanotron_ext.subspace.codec import SubspaceDecoder

    hub = hub_for(_model_cfg(grassmann_every=3))
    dec = SubspaceDecoder(hub, 2, accumulate=True)
    ids = torch.randint(0, 50, (2, 3))
    expected = torch.zeros(16, 16)
    for _ in range(2):
        x, h = dec(torch.randn(2, 3, 4, requires_grad=True), ids)
        g1, g2 = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
        (x * g1).sum().add((h * g2).sum()).backward()
        g = (g1 + g2).reshape(-1, 16)
        expected += g.T @ g
    torch.testing.assert_close(dec.grad_gram, expected, rtol=1e-5, atol=1e-5)
    assert dec in hub.decoders


def _reference_column_mean_adamw(w, grads, lr, b1, b2, eps, wd):
    """Sec. 5 written out in float64: v is the mean over the d output coordinates of g^2, per input column."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros(w.shape[1], dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g * g).sum(0) / g.shape[0]
        w = w * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)[None, :]
    return w


def test_modified_adamw_matches_its_formula_and_keeps_the_span() -> None:
    from nanotron_ext.subspace import ColumnMeanAdamW, make_basis

    u = make_basis(16, 4, seed=0)
    p = u @ torch.randn(4, 6)
    w0 = p.clone()
    grads = [u @ torch.randn(4, 6) * s for s in (1.0, 0.1, 3.0)]  # columns in span(U), uneven scales
    w = torch.nn.Parameter(p.clone())
    plain = torch.nn.Parameter(p.clone())
    opt = ColumnMeanAdamW([w], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([plain], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        w.grad, plain.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    expected = _reference_column_mean_adamw(w0, grads, 0.1, 0.9, 0.95, 1e-8, 0.1)
    torch.testing.assert_close(w.detach().double(), expected, rtol=1e-5, atol=1e-6)

    def off(x: torch.Tensor) -> float:
        return float((x - u @ (u.T @ x)).norm() / x.norm())

    assert off(w.detach()) <= 1e-6
    assert off(plain.detach()) > 1e-2  # plain AdamW's per-coordinate v rotates columns out of span(U)


def test_grassmann_step_is_a_riemannian_descent_step_on_the_stiefel_basis() -> None:
    from nanotron_ext.subspace.grassmann import grassmann_objective, grassmann_step, retract, riemannian_grad

    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(12, 3, generator=g, dtype=torch.float64))[0]
    grads = torch.randn(40, 12, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(3, 0.1, 12, dtype=torch.float64))
    a = grads.T @ grads
    xi = riemannian_grad(a, u)
    torch.testing.assert_close(u.T @ xi, torch.zeros(3, 3, dtype=torch.float64), atol=1e-6, rtol=0)
    # the Euclidean gradient of f by autograd, projected onto the tangent space
    leaf = u.clone().requires_grad_()
    grassmann_objective(a, leaf).backward()
    torch.testing.assert_close(xi, leaf.grad - u @ (u.T @ leaf.grad), rtol=1e-10, atol=1e-10)
    new = grassmann_step(a, u, lr=0.05)
    torch.testing.assert_close(new.T @ new, torch.eye(3, dtype=torch.float64), atol=1e-6, rtol=0)
    assert grassmann_objective(a, new) < grassmann_objective(a, u)
    assert (new - u).abs().max() > 1e-4
    y = u * torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    q = retract(y)  # sign convention: R = Q^T y has a positive diagonal, so a basis maps to itself
    assert torch.all(torch.diagonal(q.T @ y) > 0)
    torch.testing.assert_close(q, u * torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64), atol=1e-10, rtol=0)


def test_configuration_errors_name_the_keys() -> None:
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.subspace.codec import SubspaceCodec

    lone = from_dict(ModelConfig, {"codec": {"kind": "subspace"}})
    with pytest.raises(ConfigError, match="model.codec.kind='subspace' is exact only with model.embedding.kind"):
        SubspaceCodec(lone, None)
    with pytest.raises(ConfigError, match="model.subspace.k: 999 exceeds model.hidden_size"):
        from_dict(ModelConfig, {"subspace": {"k": 999}})
    with pytest.raises(ConfigError, match="model.subspace.grassmann_lr"):
        from_dict(ModelConfig, {"subspace": {"grassmann_lr": 0}})
