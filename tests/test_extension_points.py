"""The core's extension points, exercised by a sixth technique that touches only its own folder: the toy
package in tests/toy_technique/ (the worked example of ARCHITECTURE.md), found through the
`nanotron_ext.techniques` entry point of its dist-info exactly as an installed plug-in is:

- its config sections (model.codec.toy, toy_sync) load, override, show and document like core ones, and
  its names are checked at load without importing its pieces;
- codec boundaries (`model.codec.boundaries`): a truncating codec after every layer on one process
  gives the same loss and gradients as the same placement split over PP=2, its wire bytes equal
  mbs * seq * h * 4 per boundary per direction, and a list placement changes only the listed layers;
- token embeddings (`model.embedding.kind`): the toy's builder is what the model uses
  (checked against the standard model with a doubled table, an independent construction);
- output constraints (`model.output_constraint.kind`): applied at build time and after every
  optimiser step (weights stay in a fixed span; without the hook they leave it);
- optimiser groups (`tag_parameter` + a declared "optimizer group"): tagged parameters are stepped by
  the technique's optimiser (checked against the plain SGD formula);
- DP sync (`parallelism.dp_sync`): an outer loop replaces the per-step gradient all-reduce; replicas
  drift between syncs, are identical after one, and no gradient bytes cross the DP group.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_micro_batches, one_step, small_config

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "tests" / "toy_technique"
MODEL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=16)
SEQ, MB, N_MICRO, H = 8, 2, 2, 8  # H: the toy codec's wire width


def _use_toy() -> None:
    """Make the toy package importable in this (worker) process: its dist-info then lists its entry point,
    which the registry reads on first use. The pytest process itself never loads it."""
    sys.path.insert(0, str(TOY))


def _toy_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOY), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _toy_basis(d: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, 4, generator=torch.Generator().manual_seed(3)))[0]


def _config(model: dict, parallelism: dict, extra: dict = None):
    if (model.get("codec") or {}).get("kind") == "toy_trunc":
        model = {**model, "codec": {**model["codec"], "toy": {"width": H}}}
    return small_config({**MODEL, **model}, seq=SEQ, mb=MB, n_micro=N_MICRO, parallelism=parallelism, **(extra or {}))


def _micro(seed: int) -> List[Dict[str, torch.Tensor]]:
    return fixed_micro_batches(N_MICRO, MB, SEQ, MODEL["vocab_size"], seed)


def _run_model(pp: int, engine: str, model_overrides: dict) -> dict:
    """Loss, gradients by name and pipeline bytes of one forward/backward."""
    _use_toy()
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=1, tp=1, pp=pp, backend="gloo")
    cfg = _config(model_overrides, {"pp": pp, "pp_engine": engine})
    model = build_model(cfg, ctx)
    loss, comm = one_step(model, _micro(0), ctx, engine)
    grads = {n.replace("pp_block.", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads, "comm": comm}


def _merge(results: List[dict]) -> Tuple[float, Dict[str, torch.Tensor]]:
    grads: Dict[str, torch.Tensor] = {}
    for r in results:
        grads.update(r["grads"])
    return results[0]["loss"], grads


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["1f1b", "afab"])
def test_codec_after_every_layer_on_one_process_equals_the_same_placement_over_pp2(engine: str) -> None:
    codec = {"codec": {"kind": "toy_trunc", "boundaries": "every_layer"}}
    one = run_distributed(_run_model, 1, 1, engine, codec)
    two = run_distributed(_run_model, 2, 2, engine, codec)
    plain = run_distributed(_run_model, 1, 1, engine, {})
    loss1, g1 = _merge(one)
    loss2, g2 = _merge(two)
    assert abs(loss1 - plain[0]["loss"]) > 1e-3, "the toy codec must change the model"
    assert abs(loss1 - loss2) <= 1e-6 * abs(loss1)
    assert sorted(g1) == sorted(g2)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-7, msg=name)
    # one boundary crosses the link (after layer 1): H floats per token each way, per micro-batch
    per_micro = MB * SEQ * H * 4
    sender, receiver = two[0]["comm"]["pp"], two[1]["comm"]["pp"]
    assert sender["send:fwd"]["bytes"] == N_MICRO * per_micro
    assert receiver["send:bwd"]["bytes"] == N_MICRO * per_micro


@pytest.mark.slow
def test_codec_boundary_list_changes_only_the_listed_layers() -> None:
    """A list placement [2] on one process equals every_layer minus boundaries 0 and 1: checked by
    comparing with a 3-stage PP run where only the 2->3 boundary carries the codec."""
    listed = run_distributed(_run_model, 1, 1, "1f1b", {"codec": {"kind": "toy_trunc", "boundaries": [2]}})
    # layers_per_stage is a parallelism key; the same placement over pp=2 puts layer 2 last on stage 0
    split = run_distributed(_run_stages_2_2, 2)
    assert abs(listed[0]["loss"] - split[0]["loss"]) <= 1e-6 * abs(split[0]["loss"])
    stages = run_distributed(_run_model, 2, 2, "1f1b", {"codec": {"kind": "toy_trunc", "boundaries": "stages"}})
    assert abs(listed[0]["loss"] - stages[0]["loss"]) > 1e-4, "boundary 2 and boundary 1 must differ"


def _run_stages_2_2() -> dict:
    """PP=2 with 3 + 1 layers: the stage boundary after layer 2 is the codec boundary."""
    _use_toy()
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=1, tp=1, pp=2, backend="gloo")
    cfg = _config({"codec": {"kind": "toy_trunc", "boundaries": "stages"}}, {"pp": 2, "layers_per_stage": [3, 1]})
    model = build_model(cfg, ctx)
    return {"loss": forward_backward(model, make_engine("1f1b"), _micro(0), ctx).item()}


def _run_embedding_and_constraint(kind: str, constraint: str) -> dict:
    _use_toy()
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo")
    cfg = _config({"embedding": {"kind": kind}, "output_constraint": {"kind": constraint}}, {})
    model = build_model(cfg, ctx)
    if kind == "standard" and constraint == "none":  # the reference for toy_doubled: double the table itself
        table = model.token_embedding.pp_block.embedding.weight
        with torch.no_grad():
            table.mul_(2)
    u = _toy_basis(MODEL["hidden_size"])
    outs = [p for n, p in model.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))]

    def off_span() -> float:
        return max(float((w - u @ (u.T @ w)).norm() / w.norm()) for w in (p.detach() for p in outs))

    before = off_span()
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    loss = forward_backward(model, make_engine("1f1b"), _micro(0), ctx)
    opt.step()
    after_step = off_span()
    model.after_optimizer_step()
    return {"loss": loss.item(), "before": before, "after_step": after_step, "after_hook": off_span()}


@pytest.mark.slow
def test_embedding_builder_is_used() -> None:
    doubled = run_distributed(_run_embedding_and_constraint, 1, "toy_doubled", "none")[0]
    reference = run_distributed(_run_embedding_and_constraint, 1, "standard", "none")[0]
    assert abs(doubled["loss"] - reference["loss"]) <= 1e-6 * reference["loss"]


@pytest.mark.slow
def test_output_constraint_applies_at_build_and_after_every_step() -> None:
    r = run_distributed(_run_embedding_and_constraint, 1, "standard", "toy_span")[0]
    assert r["before"] <= 1e-6  # projected at build time
    assert r["after_step"] > 1e-3  # the optimiser step leaves the span...
    assert r["after_hook"] <= 1e-6  # ...and the hook restores it
    free = run_distributed(_run_embedding_and_constraint, 1, "standard", "none")[0]
    assert free["before"] > 0.5  # without the constraint the weights are nowhere near a 4-dim span


def _tagged_parameters() -> dict:
    _use_toy()
    from nanotron_ext.config.schema import OptimizerConfig
    from nanotron_ext.optim.build import ChainedOptimizer, build_optimizer
    from nanotron_ext.optim.param_groups import tag_parameter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    tag_parameter(model[1].weight, "toy_sgd")
    cfg = OptimizerConfig(lr=0.1)
    opt = build_optimizer(model, cfg, None)
    assert isinstance(opt, ChainedOptimizer)
    assert isinstance(opt.optimizers[-1], torch.optim.SGD)
    assert [p for g in opt.optimizers[-1].param_groups for p in g["params"]] == [model[1].weight]
    adamw_params = {id(p) for o in opt.optimizers[:-1] for g in o.param_groups for p in g["params"]}
    assert id(model[1].weight) not in adamw_params and id(model[0].weight) in adamw_params
    model(torch.randn(3, 4)).square().sum().backward()
    expected = model[1].weight.detach() - 0.1 * model[1].weight.grad  # plain SGD, by its formula
    opt.step()
    torch.testing.assert_close(model[1].weight.detach(), expected)
    return {"ok": True}


def test_tagged_parameters_go_to_the_technique_optimizer() -> None:
    assert run_distributed(_tagged_parameters, 1)[0]["ok"]


def _run_outer_loop() -> dict:
    _use_toy()
    import nanotron.distributed as dist

    from nanotron_ext.models.build import build_dp_sync, build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context

    ctx = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    cfg = _config({}, {"dp": 2, "dp_sync": "toy_average"}, {"toy_sync": {"every": 2}})
    model = build_model(cfg, ctx)
    opt = build_optimizer(model, cfg.optimizer, ctx.tp_pg)
    sync = build_dp_sync(cfg, model, ctx)
    rank = dist.get_rank(ctx.dp_pg)
    out: dict = {"dp_bytes": [], "checksum": []}
    for step in (1, 2):
        _, comm = one_step(model, _micro(10 * step + rank), ctx, dp_sync=sync)
        grad_bytes = comm.get("dp", {})
        out["dp_bytes"].append(sum(v["bytes"] for v in grad_bytes.values()))
        opt.step()
        opt.zero_grad()
        sync.after_step(step)
        out["checksum"].append(float(sum(p.double().sum() for p in model.parameters())))
    return out


@pytest.mark.slow
def test_outer_loop_replaces_the_gradient_all_reduce() -> None:
    a, b = run_distributed(_run_outer_loop, 2)
    assert a["checksum"][0] != b["checksum"][0], "replicas must drift without a gradient all-reduce"
    assert a["checksum"][1] == b["checksum"][1], "and agree exactly after the outer sync"
    # during forward_backward only the logged loss (one fp32 scalar) crosses the DP group
    assert a["dp_bytes"] == [4, 4] and b["dp_bytes"] == [4, 4]


def test_unknown_extension_names_fail_naming_the_key_and_the_choices() -> None:
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config, ConfigError

    for section, key in ((("model", "codec"), "kind"), (("model", "embedding"), "kind"),
                         (("model", "output_constraint"), "kind")):
        with pytest.raises(ConfigError, match=f"{'.'.join(section)}.{key}: 'nope' is not available; registered"):
            from_dict(Config, {section[0]: {section[1]: {key: "nope"}}})
    with pytest.raises(ConfigError, match="parallelism.dp_sync: 'nope' is not available"):
        from_dict(Config, {"parallelism": {"dp_sync": "nope"}})
    with pytest.raises(ConfigError, match="model.tp_strategy: 'nope' is not available"):
        from_dict(Config, {"model": {"tp_strategy": "nope"}})
    with pytest.raises(ConfigError, match=r"model.codec.boundaries: \[3\]"):
        from_dict(Config, {"model": {"codec": {"boundaries": [3]}}})


def test_registered_names_include_the_techniques() -> None:
    from nanotron_ext.registry import CODECS, DP_SYNCS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES

    assert {"megatron", "vanilla", "btp"} <= set(TP_STRATEGIES.names())
    assert {"identity", "resbm", "mapl", "subspace"} <= set(CODECS.names())
    assert {"standard", "subspace", "subspace_adapted"} <= set(EMBEDDINGS.names())
    assert {"none", "subspace"} <= set(OUTPUT_CONSTRAINTS.names()) and {"allreduce",
                                                                        "sparseloco"} <= set(DP_SYNCS.names())
    assert "toy_trunc" not in CODECS.names()  # the toy is only on the path of its own tests' processes


def _config_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanotron_ext.config", *args], cwd=REPO, env=_toy_env(),
                          capture_output=True, text=True, timeout=120)


def test_a_technique_outside_the_repository_plugs_in_through_its_entry_point() -> None:
    """The toy's sections are documented, shown, overridden and checked like core sections; its names are
    accepted; nothing of it is imported beyond its light declaration until a model is built."""
    doc = _config_cli("doc")
    assert doc.returncode == 0, doc.stderr
    assert "[model.codec.toy] (technique toy)  Options of the toy_trunc codec" in doc.stdout
    assert "[toy_sync] (technique toy)  Options of the toy_average DP sync" in doc.stdout
    assert "Optimiser steps between parameter averages over the DP group." in doc.stdout
    show = _config_cli("show", "--set", "model.codec.kind=toy_trunc", "--set", "model.codec.boundaries=every_layer",
                       "--set", "toy_sync.every=3", "--set", "parallelism.dp_sync=toy_average")
    assert show.returncode == 0, show.stderr
    assert "  toy:\n      width: 8\n" in show.stdout and "toy_sync:\n  every: 3\n" in show.stdout
    for bad, message in ((["toy_sync.evry=3"], "toy_sync.evry: unknown key; did you mean 'every'?"),
                         (["toy_sync.every=x"], "toy_sync.every: expected int, got 'x' (str)"),
                         (["toy_sync.every=0"], "toy_sync.every: must be >= 1, got 0"),
                         (["model.codec.kind=toy_trunc", "model.codec.boundaries=every_layer",
                           "model.codec.toy.width=128"], "model.codec.toy.width: 128 must be < model.hidden_size=128")):
        out = _config_cli("show", *[a for kv in bad for a in ("--set", kv)])
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)
    light = subprocess.run([sys.executable, "-c", "import sys\nfrom nanotron_ext.config.loader import load_config\n"
                            "load_config('examples/config_tiny_llama.yaml', ['model.codec.kind=toy_trunc', "
                            "'model.codec.boundaries=every_layer', 'parallelism.dp_sync=toy_average'])\n"
                            "print(sorted(m for m in sys.modules if m.startswith(('toy_technique', 'torch'))))"],
                           cwd=REPO, env=_toy_env(), capture_output=True, text=True, timeout=120)
    assert light.returncode == 0, light.stderr
    assert light.stdout.strip() == "['toy_technique', 'toy_technique.config', 'toy_technique.technique']"


def test_registration_mistakes_fail_naming_the_technique() -> None:
    """A name two techniques provide, or a section mounted where no core section is, or over a core key."""
    code = '''
import dataclasses
from nanotron_ext.config.compose import register_technique
from nanotron_ext.technique import Technique
from nanotron_ext.config.schema import Config

@dataclasses.dataclass(kw_only=True)
class S:
    x: int = 1

def attempt(name, **attrs):
    t = type("Bad", (Technique,), {"name": name, **attrs})()
    try:
        register_technique(t)
        Config()
    except (TypeError, ValueError) as e:
        print(str(e).split(";")[0])

attempt("bad", provides={"model.codec.kind": ["resbm"]})
attempt("bad2", sections={"nowhere.s": S})
attempt("bad3", sections={"model.hidden_size": S})
'''
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "model.codec.kind: ['resbm'] provided by both 'resbm' and 'bad'",
        "technique 'bad2' mounts S at 'nowhere.s', but 'nowhere' is not a core config section",
        "technique 'bad3' mounts a section at 'model.hidden_size', which is already a key",
    ]


def test_a_technique_whose_dependency_is_not_registered_fails_at_load_naming_both(tmp_path: Path) -> None:
    """Technique.requires: a config choosing a name of a technique that builds on one not registered here is one
    config error naming the key, both techniques and what is registered (SparseLoCo declares Subspace Models)."""
    code = '''
import sys
from nanotron_ext.config.compose import register_technique
from nanotron_ext.config.loader import load_config
from nanotron_ext.config.schema import ConfigError
from nanotron_ext.registry import TECHNIQUES
from nanotron_ext.technique import Technique

empty = sys.argv[1]
assert TECHNIQUES.get("sparseloco").requires == ("subspace",)
load_config(empty, ["parallelism.dp_sync=sparseloco"])  # subspace is registered: loads

class Needy(Technique):
    name = "needy"
    provides = {"parallelism.dp_sync": ["needy_sync"]}
    requires = ("absent",)

register_technique(Needy())  # registering is fine: only a config that chooses it needs "absent"
load_config(empty, [])
try:
    load_config(empty, ["parallelism.dp_sync=needy_sync"])
except ConfigError as e:
    print(e)
'''
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")  # every default (an empty file is refused)
    out = subprocess.run([sys.executable, "-c", code, str(empty)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "parallelism.dp_sync: 'needy_sync' is technique 'needy', which needs technique 'absent', and 'absent' is not "
        "registered (registered: ['boost', 'core', 'mapl', 'needy', 'resbm', 'sparseloco', 'subspace']); install the "
        "package that provides 'absent', or choose another parallelism.dp_sync"]
