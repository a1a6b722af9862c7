"""Heterogeneous SparseLoCo (sec. 2.3, 2.4): per-replica pipeline codec from YAML, embedding adaptation
against plain-torch references, replicas bit-identical after every sync, the Table 4 switches."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from nanotron_ext.config.loader import load_config
from nanotron_ext.config.schema import ConfigError
from tests.helpers.dist import run_distributed
from tests.helpers.references import adapt_
from tests.test_trainer import TINY, _small_overrides

HET = ["parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", "sparseloco.topk=8",
       "sparseloco.compressed_replicas=[0]", "model.subspace.k=8"]


def _adapted(compressed: bool = True):
    """A standalone adapted embedding (V = 64, d = 16, k = 4) with a random T_S and T_fixed."""
    from nanotron_ext.config.schema import ModelConfig
    from nanotron_ext.subspace.basis import SubspaceHub
    from nanotron_ext.subspace.embedding import AdaptedSplitEmbedding

    cfg = ModelConfig(vocab_size=64, hidden_size=16, ffn_size=32, num_heads=2, num_kv_heads=2, num_layers=2,
                      tie_embeddings=False)
    cfg.subspace.k = 4
    cfg.embedding.kind = "subspace_adapted"
    emb = AdaptedSplitEmbedding(cfg, SubspaceHub(cfg), compressed)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        emb.table.weight.copy_(torch.randn(64, 16, generator=g))
        emb.hub.fixed.copy_(torch.randn(64, 16, generator=g))
    return emb


def test_initial_split_and_adaptation_match_reference() -> None:
    from nanotron_ext.sparseloco.hetero import split_

    emb = _adapted()
    u = emb.hub.basis.double()
    p = u @ u.T  # the reference projector, float64
    t = emb.table.weight.detach().double().clone()
    split_(emb, adaptation=True)
    torch.testing.assert_close(emb.table.weight.double(), t @ p, rtol=0, atol=1e-5)
    torch.testing.assert_close(emb.hub.fixed.double(), t - t @ p, rtol=0, atol=1e-5)
    # an outer step moves T_S out of span(U); adaptation folds the out-of-span part into T_fixed
    with torch.no_grad():
        emb.table.weight.add_(torch.randn(64, 16, generator=torch.Generator().manual_seed(4)))
    t_s, t_fixed = emb.table.weight.detach().double().clone(), emb.hub.fixed.double().clone()
    assert (t_s - t_s @ p).abs().max() > 0.1  # the test can fail: T_S is really off the subspace
    adapt_(emb)
    new_s, new_fixed = emb.table.weight.double(), emb.hub.fixed.double()
    torch.testing.assert_close(new_s + new_fixed, t_s + t_fixed, rtol=0, atol=1e-5)  # sum unchanged
    torch.testing.assert_close(new_s @ p, new_s, rtol=0, atol=1e-5)  # T_S U U^T = T_S
    torch.testing.assert_close(new_fixed, t_fixed + t_s - t_s @ p, rtol=0, atol=1e-5)


def test_compressed_and_uncompressed_embeddings_agree_on_an_adapted_table() -> None:
    comp, plain = _adapted(True), _adapted(False)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    assert not torch.allclose(comp(ids), plain(ids), atol=1e-3)  # T_S off span(U): the two forms differ
    adapt_(comp)
    adapt_(plain)
    torch.testing.assert_close(comp(ids), plain(ids), rtol=0, atol=1e-5)
    t = comp.table.weight + comp.hub.fixed  # the uncompressed replica's table: T_S + T_fixed
    torch.testing.assert_close(plain(ids), t[ids], rtol=0, atol=1e-5)


def test_replica_model_config_per_replica_codec_and_switches() -> None:
    from nanotron_ext.models.build import replica_config

    cfg = load_config(TINY, ["parallelism.dp=2", "parallelism.dp_sync=sparseloco", "model.tie_embeddings=false",
                             "sparseloco.compressed_replicas=[0]", "sparseloco.weight_projection=true",
                             "sparseloco.modified_adamw=true", "model.codec.boundaries=every_layer"])
    c0, c1 = replica_config(cfg, 0), replica_config(cfg, 1)
    assert (c0.model.codec.kind, c0.model.output_constraint.kind, c0.model.embedding.kind) == \
        ("subspace", "subspace", "subspace_adapted")
    assert (c1.model.codec.kind, c1.model.output_constraint.kind, c1.model.embedding.kind) == \
        ("identity", "none", "subspace_adapted")
    sub = c0.model.subspace
    assert (sub.parameterisation, sub.reproject, sub.modified_adamw) == ("projection", True, True)
    assert c0.model is not c1.model and cfg.model.codec.kind == "identity"  # the run's config is untouched
    import copy
    import pickle

    assert copy.deepcopy(c0) == c0 and pickle.loads(pickle.dumps(c0)) == c0  # a derived config copies as it is
    plain = load_config(TINY, ["parallelism.dp=2", "parallelism.dp_sync=sparseloco"])
    assert replica_config(plain, 1) is plain  # no compressed replicas: plain SparseLoCo
    defaults = replica_config(load_config(TINY, ["parallelism.dp=2", "parallelism.dp_sync=sparseloco",
                                                 "model.tie_embeddings=false", "model.codec.boundaries=every_layer",
                                                 "sparseloco.compressed_replicas=[1]"]), 1)
    assert (defaults.model.subspace.reproject, defaults.model.subspace.modified_adamw) == (False, False)


@pytest.mark.parametrize("extra,key", [
    (["sparseloco.compressed_replicas=[2]"], "sparseloco.compressed_replicas"),
    (["sparseloco.compressed_replicas=[0]", "model.codec.kind=subspace"], "model.codec.kind"),
    (["sparseloco.grassmann_every=10"], "sparseloco.grassmann_every"),  # no compressed replica drives U
    (["sparseloco.compressed_replicas=[0]", "sparseloco.grassmann_every=15"], "sparseloco.grassmann_every"),
    (["sparseloco.compressed_replicas=[0]", "model.subspace.grassmann_every=10"], "model.subspace.grassmann_every"),
    (["sparseloco.compressed_replicas=[0]", "parallelism.dp_sync=allreduce"], "sparseloco.compressed_replicas"),
    # a compressed replica needs a boundary for its codec: none at pp = 1 with boundaries "stages"
    (["sparseloco.compressed_replicas=[0]", "model.codec.boundaries=stages"], "sparseloco.compressed_replicas"),
])
def test_config_errors_name_the_key(extra: list, key: str) -> None:
    from nanotron_ext.models.build import replica_config

    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        base = ["parallelism.dp=2", "parallelism.dp_sync=sparseloco", "model.tie_embeddings=false",
                "model.codec.boundaries=every_layer"]
        cfg = load_config(TINY, base + extra)
        cfg.validate()
        replica_config(cfg, 0)


def _checksums(model: torch.nn.Module) -> dict:
    """Every parameter and persistent buffer (T_S, T_fixed, U, ...) of one replica, by name."""
    return {k: v.detach().double().sum().item() for k, v in model.state_dict().items() if v.is_floating_point()}


def _sim_worker(overrides: list) -> dict:
    """Simulated M = 2 heterogeneous run; records both replicas' checksums after every outer sync."""
    from nanotron_ext.sparseloco.hetero import find_embedding
    from nanotron_ext.sparseloco.simulate import SimulatedReplicas, run_simulated

    after_sync, plain_init, plain_sync = [], SimulatedReplicas.__init__, SimulatedReplicas.sync

    def init(self: SimulatedReplicas, models: list, cfg: object) -> None:
        plain_init(self, models, cfg)
        self.models = models  # the caller's modules: buffers (T_fixed, U) are checksummed too

    def recording_sync(self: SimulatedReplicas) -> None:
        plain_sync(self)
        after_sync.append([_checksums(m) for m in self.models])

    SimulatedReplicas.__init__, SimulatedReplicas.sync = init, recording_sync
    out = run_simulated(load_config(TINY, overrides), 2, "sparseloco")
    models = out["models"]
    emb = [find_embedding(m) for m in models]
    return {"after_sync": after_sync, "weights": out["weights"], "t_s": [e.table.weight.detach().clone() for e in emb],
            "basis": emb[0].hub.basis.clone(), "compressed": [e.compressed for e in emb],
            "codecs": [sorted(type(e).__name__ for e in m.codec_encoders.values()) for m in models]}


@pytest.mark.slow
@pytest.mark.parametrize("adaptation,grassmann", [(True, 0), (False, 0), (True, 2)])
def test_simulated_heterogeneous_replicas_identical_after_every_sync(small_corpus: Path, tmp_path: Path,
                                                                     adaptation: bool, grassmann: int) -> None:
    """M = 2, replica 0 compressed (subspace codec after layer 1, on one process), replica 1 not; 4 steps,
    H = 2: after both syncs the replicas agree bit for bit on every parameter and buffer (T_fixed, U too).
    With Grassmann updates at every sync, U has left the seeded basis, stays orthonormal, and T_S was
    re-projected onto the new U."""
    from nanotron_ext.subspace.basis import make_basis

    ovr = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 4) + HET + [
        "model.codec.boundaries=[1]", f"sparseloco.embedding_adaptation={str(adaptation).lower()}",
        f"sparseloco.grassmann_every={grassmann}"]
    out = run_distributed(_sim_worker, 1, ovr)[0]
    assert out["codecs"] == [["SubspaceEncoder"], ["IdentityEncoder"]] and out["compressed"] == [True, False]
    assert len(out["after_sync"]) == 2
    for r0, r1 in out["after_sync"]:  # the codec's modules exist on replica 0 only: compare the shared names
        shared = sorted(set(r0) & set(r1))
        assert len(shared) >= len(out["weights"][1]) + 2  # every parameter, U and T_fixed
        assert {k: r0[k] for k in shared} == {k: r1[k] for k in shared}
        assert r0["decoder.2.pp_block.boundary_decoder.hub.fixed"] == r1["token_embedding.pp_block.embedding.hub.fixed"]
    t_s, u = out["t_s"][0], out["basis"]
    torch.testing.assert_close(u.T @ u, torch.eye(u.shape[1]), rtol=0, atol=1e-6)
    moved = (u - make_basis(u.shape[0], u.shape[1], 0)).abs().max().item()
    assert (moved > 1e-4) if grassmann else (moved == 0)
    off_span = (t_s - t_s @ u @ u.T).abs().max().item()
    if adaptation:  # T_S re-projected after the last sync (step 4)
        assert off_span < 1e-5
    else:  # the control: without adaptation the averaged T_S leaves span(U)
        assert off_span > 1e-4


def _het_train_worker(overrides: list, stop_after, interval: int) -> dict:
    """The trainer on this rank; returns its DP / PP coordinates and its full state (parameters and buffers)."""
    from nanotron import distributed as dist

    from nanotron_ext.train.trainer import Trainer

    trainer = Trainer(load_config(TINY, overrides + [f"checkpoints.interval={interval}"]))
    trainer.train(stop_after=stop_after)
    return {"dp": dist.get_rank(trainer.ctx.dp_pg), "pp": dist.get_rank(trainer.ctx.pp_pg),
            "codec": trainer.replica.model.cfg.codec.kind,
            "state": {k: v.detach().clone() for k, v in trainer.replica.model.state_dict().items()}}


@pytest.mark.slow
def test_heterogeneous_dp2_pp2_trains_and_resumes_bit_exactly(small_corpus: Path, tmp_path: Path) -> None:
    """dp = 2 x pp = 2, replica 0 compressed (subspace codec at the stage boundary), replica 1 not, H = 2.
    The run interrupted after the step-3 checkpoint (mid inner loop) and resumed equals the straight run
    bit for bit (losses, parameters, T_fixed on both stages); after the last sync (step 6) the two replicas
    hold the same parameters and T_fixed, and the decoding stage's T_fixed is the embedding stage's. One
    Grassmann update (step 4) moved U, identically on every rank that holds it."""
    from nanotron_ext.subspace.basis import make_basis
    from tests.test_trainer import _losses

    n, world = 3, 4
    grassmann = ["sparseloco.grassmann_every=4"]  # one shared-U update, at the step-4 sync (after the resume)
    ovr_a = _small_overrides(small_corpus, tmp_path / "a", 2, 1, 2, 2 * n) + HET + grassmann
    straight = run_distributed(_het_train_worker, world, ovr_a, None, 0)
    ovr_b = _small_overrides(small_corpus, tmp_path / "b", 2, 1, 2, 2 * n) + HET + grassmann
    run_distributed(_het_train_worker, world, ovr_b, n, n)
    resumed = run_distributed(_het_train_worker, world, ovr_b, None, n)
    a, b = _losses(tmp_path / "a" / "tiny_llama"), _losses(tmp_path / "b" / "tiny_llama")
    assert sorted(a) == list(range(1, 2 * n + 1)) and all(a[s] == b[s] for s in range(n + 1, 2 * n + 1))
    for ra, rb in zip(straight, resumed):
        assert sorted(ra["state"]) == sorted(rb["state"])
        for k in ra["state"]:
            assert torch.equal(ra["state"][k], rb["state"][k]), (ra["dp"], ra["pp"], k)
    by = {(r["dp"], r["pp"]): r for r in straight}
    assert by[0, 0]["codec"] == "subspace" and by[1, 0]["codec"] == "identity"
    assert "decoder.2.pp_block.boundary_decoder.hub.fixed" in by[0, 1]["state"]  # the compressed pipeline decodes
    for pp in (0, 1):
        s0, s1 = by[0, pp]["state"], by[1, pp]["state"]
        params = [k for k in s1 if k in s0 and "hub" not in k and "grad_gram" not in k]
        assert len(params) >= 4
        assert all(torch.equal(s0[k], s1[k]) for k in params), pp
    emb_fixed = "token_embedding.pp_block.embedding.hub.fixed"
    assert torch.equal(by[0, 0]["state"][emb_fixed], by[1, 0]["state"][emb_fixed])
    assert torch.equal(by[0, 0]["state"][emb_fixed], by[0, 1]["state"]["decoder.2.pp_block.boundary_decoder.hub.fixed"])
    t_s = by[0, 0]["state"]["token_embedding.pp_block.embedding.table.weight"]
    u = by[0, 0]["state"]["token_embedding.pp_block.embedding.hub.basis"]
    torch.testing.assert_close(t_s @ u @ u.T, t_s, rtol=0, atol=1e-5)  # adapted after the last sync
    assert (u - make_basis(u.shape[0], u.shape[1], 0)).abs().max() > 1e-4  # the Grassmann update moved U
    bases = [v for r in straight for k, v in r["state"].items() if k.endswith("hub.basis")]
    assert len(bases) >= 4 and all(torch.equal(b, u) for b in bases)


def _sim_weights_worker(overrides: list) -> list:
    from nanotron_ext.sparseloco.simulate import run_simulated

    out = run_simulated(load_config(TINY, overrides), 2, "sparseloco")
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in out["models"]]


@pytest.mark.slow
@pytest.mark.parametrize("grassmann", [0, 2])
def test_heterogeneous_simulated_equals_distributed_dp2(small_corpus: Path, tmp_path: Path, grassmann: int) -> None:
    """dp = 2 (pp = 1, the subspace codec after layer 1 on replica 0): run_simulated gives the trainer's
    per-replica parameters and buffers bit for bit, at step 5 (mid inner loop, after two syncs), with and
    without Grassmann updates of the shared U at every sync."""
    ovr = HET + ["model.codec.boundaries=[1]", f"sparseloco.grassmann_every={grassmann}"]
    dist_out = run_distributed(_het_train_worker, 2, _small_overrides(small_corpus, tmp_path / "t", 2, 1, 1, 5) + ovr,
                               None, 0)
    sim = run_distributed(_sim_weights_worker, 1, _small_overrides(small_corpus, tmp_path / "s", 2, 1, 1, 5) + ovr)[0]
    for r in dist_out:
        assert sorted(r["state"]) == sorted(sim[r["dp"]])
        for k, v in r["state"].items():
            assert torch.equal(sim[r["dp"]][k], v), (r["dp"], k)
    assert "decoder.1.pp_block.boundary_encoder.hub.fixed" in sim[0]
    assert not any("boundary_encoder.hub" in k for k in sim[1])
    assert any(not torch.equal(sim[0][k], sim[1][k]) for k in sim[1])  # mid inner loop: the replicas differ


@pytest.mark.slow
def test_weight_projection_switch(small_corpus: Path, tmp_path: Path) -> None:
    """sparseloco.weight_projection: the compressed replica's output projections sit in span(U) after an
    inner step (re-projected), the uncompressed replica's do not; off, neither replica's do."""
    in_span = {}
    for on in (True, False):
        ovr = _small_overrides(small_corpus, tmp_path / str(on), 2, 1, 1, 3) + HET + [
            "model.codec.boundaries=[1]", f"sparseloco.weight_projection={str(on).lower()}"]
        sim = run_distributed(_sim_weights_worker, 1, ovr)[0]
        u = sim[0]["token_embedding.pp_block.embedding.hub.basis"]
        w = [s["decoder.0.pp_block.attn.o_proj.weight"] for s in sim]
        in_span[on] = [bool(torch.allclose(u @ (u.T @ x), x, rtol=0, atol=1e-6)) for x in w]
    assert in_span == {True: [True, False], False: [False, False]}


def _tags_worker(overrides: list) -> list:
    """Build both replicas' models (no training) and return the optimiser tag of each o_proj weight."""
    from nanotron_ext.models.build import build_model, replica_config
    from nanotron_ext.optim.param_groups import parameter_tag
    from nanotron_ext.parallel.context import standalone_context

    cfg = load_config(TINY, overrides)
    ctx = standalone_context()
    out = []
    for r in range(2):
        model = build_model(replica_config(cfg, r), ctx)
        out.append(parameter_tag(dict(model.named_parameters())["decoder.0.pp_block.attn.o_proj.weight"]))
    return out


@pytest.mark.parametrize("on", [True, False])
def test_modified_adamw_switch_tags_the_compressed_replica_only(on: bool) -> None:
    from nanotron_ext.subspace.optim import SUBSPACE_ADAMW_TAG

    ovr = ["parallelism.dp=2", "model.tie_embeddings=false", "model.codec.boundaries=[0]", "model.num_layers=2",
           "model.hidden_size=32", "model.ffn_size=64"] + HET + [f"sparseloco.modified_adamw={str(on).lower()}"]
    tags = run_distributed(_tags_worker, 1, ovr)[0]
    assert tags == ([SUBSPACE_ADAMW_TAG, None] if on else [None, None])


def _dense_worker(overrides: list) -> list:
    from nanotron_ext.sparseloco.simulate import run_simulated

    out = run_simulated(load_config(TINY, overrides), 2, "dense")
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in out["models"]]


@pytest.mark.slow
def test_heterogeneous_replicas_under_per_step_averaging(small_corpus: Path, tmp_path: Path) -> None:
    """Table 3's setting (AdamW, gradients averaged every step, no inner loop): replica 0 compressed, replica 1
    not; the averaged gradient keeps both replicas' parameters equal after every step."""
    ovr = _small_overrides(small_corpus, tmp_path, 2, 1, 1, 2) + HET + ["model.codec.boundaries=[1]"]
    sim = run_distributed(_dense_worker, 1, ovr)[0]
    shared = [k for k in sim[1] if k in sim[0] and "hub" not in k]
    assert len(shared) >= 10 and all(torch.equal(sim[0][k], sim[1][k]) for k in shared)
    assert "decoder.1.pp_block.boundary_encoder.hub.fixed" in sim[0]


def test_shared_grassmann_update_matches_a_plain_torch_step_on_the_mean_gram() -> None:
    """Two replicas' hubs (simulated mode): the update averages A over the decoders of the LAST boundary
    (a decoder of an earlier boundary is ignored), both hubs take one U equal to a plain-torch Riemannian
    step + QR retraction on that mean, U stays orthonormal, the objective decreases, A resets."""
    from nanotron_ext.config.schema import ModelConfig
    from nanotron_ext.subspace.basis import SubspaceHub
    from nanotron_ext.subspace.codec import SubspaceDecoder
    from nanotron_ext.subspace.grassmann import grassmann_update

    def cfg() -> ModelConfig:
        c = ModelConfig(vocab_size=64, hidden_size=16, ffn_size=32, num_heads=2, num_kv_heads=2, num_layers=3,
                        tie_embeddings=False)
        c.subspace.k, c.subspace.grassmann_lr = 4, 0.3
        return c

    hubs = [SubspaceHub(cfg()), SubspaceHub(cfg())]
    g = torch.Generator().manual_seed(5)
    grams = []
    for hub in hubs:
        dec = SubspaceDecoder(hub, boundary=2, accumulate=True)
        x = torch.randn(40, 16, generator=g, dtype=torch.float64)
        dec.grad_gram.copy_((x.T @ x).float())
        grams.append(dec.grad_gram.double().clone())
    early = SubspaceDecoder(hubs[0], boundary=1, accumulate=True)
    early.grad_gram.fill_(1e6)  # not the last boundary: must not count
    u = hubs[0].basis.double().clone()
    assert grassmann_update(hubs, move_weights=False)

    a = (grams[0] + grams[1]) / 2
    a = a / torch.linalg.eigvalsh(a)[-1]
    egrad = -2 * a @ u
    xi = egrad - u @ (u.T @ egrad)
    q, r = torch.linalg.qr(u - 0.3 * xi)
    want = q * torch.sign(torch.diagonal(r))
    for hub in hubs:
        torch.testing.assert_close(hub.basis.double(), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(hub.basis.T @ hub.basis, torch.eye(4), rtol=0, atol=1e-6)
        assert all(not dec.grad_gram.any() for dec in hub.decoders)
    assert torch.allclose(u.T @ xi, torch.zeros(4, 4, dtype=torch.float64), atol=1e-5)  # U is fp32-orthonormal
    f = lambda b: torch.trace(a) - torch.trace(b.T @ a @ b)  # noqa: E731
    assert f(hubs[0].basis.double()) < f(u)


def test_dense_simulation_refuses_grassmann_updates_it_would_never_run() -> None:
    from nanotron_ext.sparseloco.simulate import run_simulated

    cfg = load_config(TINY, ["parallelism.dp=2", "parallelism.dp_sync=sparseloco", "model.tie_embeddings=false",
                             "sparseloco.compressed_replicas=[0]", "sparseloco.inner_steps=2",
                             "sparseloco.grassmann_every=2",
                             "model.codec.boundaries=every_layer"])
    with pytest.raises(ConfigError, match=r"sparseloco\.grassmann_every=2"):
        run_simulated(cfg, 2, "dense")


class _Replica(torch.nn.Module):
    """A stand-in for one replica's model: its adapted table, config and Subspace pieces (what hetero_hook reads:
    `techniques.get("subspace").hub`, as LlamaForTraining.techniques gives it)."""

    def __init__(self, compressed: bool) -> None:
        super().__init__()
        from nanotron_ext.config.schema import ModelConfig
        from nanotron_ext.subspace.basis import SubspaceHub
        from nanotron_ext.subspace.embedding import AdaptedSplitEmbedding

        self.cfg = ModelConfig(vocab_size=64, hidden_size=128, ffn_size=32, num_heads=2, num_kv_heads=2,
                               num_layers=2, tie_embeddings=False)
        self.cfg.subspace.k = 16
        self.cfg.embedding.kind = "subspace_adapted"
        self.embedding = AdaptedSplitEmbedding(self.cfg, SubspaceHub(self.cfg), compressed)
        with torch.no_grad():
            self.embedding.table.weight.copy_(torch.randn(64, 128, generator=torch.Generator().manual_seed(9)))
        pieces = types.SimpleNamespace(hub=self.embedding.hub)
        self.techniques = types.SimpleNamespace(get=lambda name: pieces if name == "subspace" else None)


def _plain_sparseloco_reference(table: torch.Tensor, changes: list, k: int, beta: float, lr: float) -> list:
    """Plain SparseLoCo on one [64, 128] table in float64, written out: two 64 x 64 chunks, per replica error
    feedback and top-k by magnitude, the mean of what was sent over all replicas, outer SGD. `changes[s][r]`:
    replica r's inner-loop change before sync s. Returns the global table after every sync."""
    def chunks(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t[:, :64].reshape(-1), t[:, 64:].reshape(-1)])

    def unchunk(c: torch.Tensor) -> torch.Tensor:
        return torch.cat([c[0].view(64, 64), c[1].view(64, 64)], dim=1)

    w = table.double().clone()
    errors = [torch.zeros(2, 4096, dtype=torch.float64) for _ in changes[0]]
    out = []
    for per_replica in changes:
        sent = []
        for r, change in enumerate(per_replica):
            acc = beta * errors[r] + chunks(-change.double())  # delta = global - local = -change
            idx = acc.abs().topk(k, dim=1).indices
            t = torch.zeros_like(acc).scatter(1, idx, acc.gather(1, idx))
            errors[r] = acc - t
            sent.append(t)
        w = w - lr * unchunk(sum(sent) / len(sent))
        out.append(w.clone())
    return out


def test_effective_embedding_follows_plain_sparseloco_after_every_sync() -> None:
    """Sec. 2.4 with the global copy of T_S projected too: given the same inner-loop changes, T_fixed + T_S
    after each of 10 syncs equals plain SparseLoCo's table (float64 reference), T_S stays in span(U) on every
    replica and in the global copy, and both replicas hold the same T_fixed. Projecting only the replicas'
    copies folds the out-of-span residual again at every sync and drifts away."""
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config
    from nanotron_ext.sparseloco.hetero import hetero_hook
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter
    from nanotron_ext.sparseloco.simulate import SimulatedReplicas

    k, beta, lr = 8, 0.95, 0.8
    cfg = from_dict(Config, {"parallelism": {"dp": 2, "dp_sync": "sparseloco"},
                             "model": {"tie_embeddings": False, "codec": {"boundaries": "every_layer"}},
                             "sparseloco": {"compressed_replicas": [0], "topk": k, "beta": beta, "outer_lr": lr,
                                            "value_dtype": "fp32", "inner_steps": 1}})
    models = {0: _Replica(True), 1: _Replica(False)}
    sim = SimulatedReplicas(list(models.values()), cfg.sparseloco)
    hook = hetero_hook(cfg, models, syncs=lambda: sim.outer.syncs)
    sim.outer = SparseLoCoOuter(sim.params[0], cfg.sparseloco)  # the global copy after the split
    sim.hooks.append(hook)
    embs = [m.embedding for m in models.values()]
    start = (embs[0].table.weight + embs[0].hub.fixed).detach().clone()  # T, split in two
    u = embs[0].hub.basis.double()
    gen = torch.Generator().manual_seed(11)
    changes = [[torch.randn(64, 128, generator=gen) * 0.1 for _ in models] for _ in range(10)]
    reference = _plain_sparseloco_reference(start, changes, k, beta, lr)
    for per_replica, want in zip(changes, reference):
        with torch.no_grad():
            for emb, change in zip(embs, per_replica):
                emb.table.weight.add_(change)  # an inner loop's change (T_S leaves span(U))
        sim.sync()
        for emb in embs:
            t_s, fixed = emb.table.weight.double(), emb.hub.fixed.double()
            torch.testing.assert_close(t_s + fixed, want, rtol=0, atol=1e-4)
            assert (t_s - t_s @ u @ u.T).abs().max() < 1e-5
        global_t_s = sim.outer.global_params[0].double()
        assert (global_t_s - global_t_s @ u @ u.T).abs().max() < 1e-5
        assert torch.equal(embs[0].hub.fixed, embs[1].hub.fixed)


def _fold_worker() -> dict:
    """pp = 2 of one compressed replica: stage 0 holds T_S (and T_fixed), stage 1 only T_fixed (its decoders').
    One outer step u with a known number of nonzero entries, then the hook's fold on both stages."""
    import nanotron.distributed as dist

    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.hetero import FOLD_TAG, HeteroHook

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    stage = dist.get_rank(ctx.pp_pg)
    cfg = from_dict(Config, {"parallelism": {"pp": 2, "dp_sync": "sparseloco"}, "model": {"tie_embeddings": False},
                             "sparseloco": {"compressed_replicas": [0], "inner_steps": 1}})
    replica = _Replica(True)
    hub = replica.embedding.hub
    emb = replica.embedding if stage == 0 else None
    ledger = get_ledger()
    ledger.reset()
    hook = HeteroHook(cfg, {0: hub}, {0: emb}, ctx.pp_pg, syncs=lambda: 1, table_index=0 if stage == 0 else None)
    hook.start(0)
    start_bytes = ledger.bytes("pp", f"broadcast:{FOLD_TAG}")
    fixed_before = hub.fixed.clone()
    table = replica.embedding.table.weight.detach().clone()  # the global copy of T_S after the split
    step = torch.zeros(64, 128)
    step.view(-1)[torch.randperm(64 * 128, generator=torch.Generator().manual_seed(2))[:300]] = 0.5
    table -= step  # an outer step with 300 nonzero entries
    ledger.reset()
    with torch.no_grad():
        hook(0, [table], "after_apply")
        if emb is not None:
            emb.table.weight.copy_(table)  # load_into: the replica takes the global copy
        hook(0, [replica.embedding.table.weight], "after_sync")
    return {"stage": stage, "start_bytes": start_bytes, "fold_bytes": ledger.bytes("pp", f"broadcast:{FOLD_TAG}"),
            "fixed_before": fixed_before, "fixed": hub.fixed.clone(), "table": table, "step": step,
            "basis": hub.basis.clone()}


@pytest.mark.slow
def test_fold_reaches_the_later_stages_as_the_steps_nonzeros() -> None:
    """The later stage of a compressed pipeline gets the fold as the outer step's nonzero entries and ends with
    T_fixed bit-identical to the embedding stage's, equal to T_fixed + (u U U^T - u) on the changed rows (float64
    reference); bytes on the pp group: V d x 4 once at start, then 8 + 8 x nnz(u) per sync."""
    from nanotron_ext.sparseloco.hetero import fold_nbytes

    s0, s1 = run_distributed(_fold_worker, 2)
    vocab, d = 64, 128
    assert s0["start_bytes"] == s1["start_bytes"] == vocab * d * 4 == fold_nbytes(None, vocab, d)
    assert s0["fold_bytes"] == s1["fold_bytes"] == 8 + 8 * 300 == fold_nbytes(300, vocab, d)
    assert torch.equal(s0["fixed"], s1["fixed"]) and torch.equal(s0["fixed_before"], s1["fixed_before"])
    u, step = s0["basis"].double(), s0["step"].double()
    rows = step.ne(0).any(dim=1)
    want = s0["fixed_before"].double()
    want[rows] += step[rows] @ u @ u.T - step[rows]
    torch.testing.assert_close(s0["fixed"].double(), want, rtol=0, atol=1e-6)
    assert torch.equal(s0["fixed"][~rows], s0["fixed_before"][~rows])  # rows the step did not touch: unchanged
    t = s0["table"].double()
    assert (t - t @ u @ u.T).abs().max() < 1e-5  # the global T_S is back in span(U)
