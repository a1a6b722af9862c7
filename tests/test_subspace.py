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
                                   "codec": {"kind": "subspace"}, "subspace": {"k": 4, **sub}})


def _hub(cfg: ModelConfig):
    from nanotron_ext.subspace.basis import SubspaceHub

    return SubspaceHub(cfg)


def test_basis_is_an_orthonormal_qr_of_a_seeded_gaussian() -> None:
    from nanotron_ext.subspace.basis import make_basis

    u = make_basis(32, 8, seed=5)
    torch.testing.assert_close(u.T @ u, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(u, make_basis(32, 8, seed=5))  # the same on every rank
    assert (u - make_basis(32, 8, seed=6)).abs().max() > 0.1
    gauss = torch.randn(32, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    q = torch.linalg.qr(gauss)[0]
    # the same span as the Gaussian's columns (a basis of it, whatever the sign convention)
    torch.testing.assert_close((u.double() @ u.double().T) @ q, q, atol=1e-6, rtol=0)


def test_codec_round_trip_is_exact_in_span_and_its_backward_is_g_u_ut() -> None:
    from nanotron_ext.subspace.codec import SubspaceDecoder, SubspaceEncoder

    hub = _hub(_model_cfg())
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
    wire = SubspaceEncoder(hub, torch.float32)(off, torch.zeros_like(off), ids)
    back, _ = SubspaceDecoder(hub, 0, accumulate=False)(wire, ids)
    assert (back - off).norm() / off.norm() > 0.1


def test_decoder_accumulates_the_gram_matrix_of_the_received_gradient() -> None:
    from nanotron_ext.subspace.codec import SubspaceDecoder

    hub = _hub(_model_cfg(grassmann_every=3))
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
    from nanotron_ext.subspace.basis import make_basis
    from nanotron_ext.subspace.optim import ColumnMeanAdamW

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
    grads = torch.randn(40, 12, generator=g,
                        dtype=torch.float64) @ torch.diag(torch.linspace(3, 0.1, 12, dtype=torch.float64))
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


def test_one_switch_brings_the_embedding_and_constraint_and_overrides_are_checked() -> None:
    """model.codec.kind: subspace alone brings the split embedding and the span(U) constraint; an override
    the codec stays exact with is kept; one that breaks exactness fails at load naming both keys."""
    from nanotron_ext.config.loader import from_dict

    lone = from_dict(ModelConfig, {"codec": {"kind": "subspace"}})
    assert (lone.embedding.kind, lone.output_constraint.kind) == ("subspace", "subspace")
    adapted = from_dict(ModelConfig, {"codec": {"kind": "subspace"}, "embedding": {"kind": "subspace_adapted"}})
    assert (adapted.embedding.kind, adapted.output_constraint.kind) == ("subspace_adapted", "subspace")
    plain = from_dict(ModelConfig, {})
    assert (plain.embedding.kind, plain.output_constraint.kind) == ("standard", "none")
    with pytest.raises(ConfigError, match="model.embedding.kind: 'standard' with model.codec.kind='subspace'"):
        from_dict(ModelConfig, {"codec": {"kind": "subspace"}, "embedding": {"kind": "standard"}})
    with pytest.raises(ConfigError, match="model.output_constraint.kind: 'none' with model.codec.kind='subspace'"):
        from_dict(ModelConfig, {"codec": {"kind": "subspace"}, "output_constraint": {"kind": "none"}})
    # the split embedding and the constraint on their own (no codec) stay possible
    alone = from_dict(ModelConfig, {"embedding": {"kind": "subspace"}, "output_constraint": {"kind": "subspace"}})
    assert alone.codec.kind == "identity"


def test_configuration_errors_name_the_keys() -> None:
    from nanotron_ext.config.loader import from_dict

    with pytest.raises(ConfigError, match="model.subspace.k: 999 exceeds model.hidden_size"):
        from_dict(ModelConfig, {"subspace": {"k": 999}})
    with pytest.raises(ConfigError, match="model.subspace.grassmann_lr"):
        from_dict(ModelConfig, {"subspace": {"grassmann_lr": 0}})
    with pytest.raises(ConfigError, match="model.subspace.modified_adamw: applies to parameterisation='projection'"):
        from_dict(ModelConfig, {"codec": {"kind": "subspace"}, "subspace": {"modified_adamw": True}})
    with pytest.raises(ConfigError, match="model.tie_embeddings: true is not supported with model.embedding.kind="
                                          "'subspace_adapted'"):
        from_dict(ModelConfig, {"embedding": {"kind": "subspace_adapted"}, "tie_embeddings": True})


def _two_models() -> dict:
    """Two models with different Subspace settings built in one process, then one trained a step."""
    import gc
    import sys

    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import standalone_context
    from nanotron_ext.subspace.pieces import hub_of
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = standalone_context()
    model_kw = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                    max_seq_len=16)
    models, hubs = [], []
    for k, seed, grassmann in ((4, 0, 0), (8, 5, 1)):
        cfg = from_dict(Config, {"model": {**model_kw, "codec": {"kind": "subspace", "boundaries": "every_layer"},
                                           "subspace": {"k": k, "seed": seed, "grassmann_every": grassmann}},
                                 "tokenizer": {"vocab_size": 260}, "tokens": {"sequence_length": 8}})
        models.append(build_model(cfg, ctx))
        hubs.append(hub_of(models[-1]))
    a, b = models
    storage = {t.untyped_storage().data_ptr() for t in list(a.parameters()) + list(a.buffers())}
    shared = [n for n, t in list(b.named_parameters()) + list(b.named_buffers())
              if t.untyped_storage().data_ptr() in storage]
    # every module of a model that holds a hub holds its own model's hub
    holders = [[id(m.hub) for m in model.modules() if hasattr(m, "hub")] for model in models]
    before = {n: t.clone() for n, t in b.state_dict().items()}
    rows = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(a, from_dict(Config, {}).optimizer, ctx.tp_pg)
    forward_backward(a, make_engine("1f1b"), [{"input_ids": rows[:, :-1], "label_ids": rows[:, 1:]}], ctx)
    opt.step()
    a.after_optimizer_step()
    unchanged = all(torch.equal(before[n], t) for n, t in b.state_dict().items())
    # nothing module-level in the package refers to either model's hub (no registry of models)
    modules = {id(vars(m)) for name, m in sys.modules.items() if name.startswith("nanotron_ext")}
    held_by_module = [type(r).__name__ for hub in hubs for r in gc.get_referrers(hub) if id(r) in modules]
    return {"k": [h.k for h in hubs], "hubs_distinct": hubs[0] is not hubs[1], "shared": shared,
            "holders": [set(h) == {id(hub)} for h, hub in zip(holders, hubs)], "unchanged": unchanged,
            "held_by_module": held_by_module,
            "module_hubs": hasattr(sys.modules["nanotron_ext.subspace.basis"], "_HUBS")}


def test_two_models_with_different_subspace_settings_share_nothing() -> None:
    """No module-level registry of models: each model build gets its own Subspace pieces and hub."""
    from tests.helpers.dist import run_distributed

    r = run_distributed(_two_models, 1)[0]
    assert r["k"] == [4, 8] and r["hubs_distinct"] and r["holders"] == [True, True]
    assert r["shared"] == [] and r["unchanged"]
    assert r["held_by_module"] == [] and not r["module_hubs"]
