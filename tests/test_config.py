"""The strict config loader: every failure names the dotted key, what was expected and what was given."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nanotron_ext.boost.config import BoostConfig
from nanotron_ext.config import (
    Config,
    ConfigError,
    LinkConfig,
    ModelConfig,
    ParallelismConfig,
    add_config_args,
    apply_overrides,
    config_from_args,
    config_to_dict,
    describe,
    from_dict,
    load_config,
    save_config,
)
from nanotron_ext.config.__main__ import _sections, render_doc
from nanotron_ext.config.__main__ import main as config_cli

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str, overrides=()) -> str:
    """The error of `text` (empty: every default, `{}`) with `overrides`."""
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text or "{}\n"), overrides)
    return str(exc.value)


# ---- files -------------------------------------------------------------------------------------

def test_empty_file_is_refused_and_empty_mapping_or_section_give_defaults(tmp_path):
    # an empty or comment-only file (cut to nothing, or the wrong file) trained every default (issue 41)
    for text in ("", "# nothing set yet\n"):
        with pytest.raises(ConfigError, match=r"run\.yaml is empty \(no YAML document"):
            load_config(write(tmp_path, text))
    assert load_config(write(tmp_path, "{}\n")) == Config()
    cfg = load_config(write(tmp_path, "model:\n  # hidden_size: 64\noptimizer:\n  lr: 0.01\n"))
    assert cfg.model == ModelConfig() and cfg.optimizer.lr == 0.01


def test_missing_file_names_path(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "nope.yaml")
    assert "not found" in str(exc.value) and str(tmp_path / "nope.yaml") in str(exc.value)


def test_invalid_yaml_names_file_and_line(tmp_path):
    msg = error_of(tmp_path, "model:\n  hidden_size: 64\n  num_heads: [4\ntokens: {}\n")
    assert "run.yaml" in msg and "invalid YAML" in msg
    assert "line 3" in msg  # where the unclosed `[` opened


def test_duplicate_key_is_rejected_with_both_lines(tmp_path):
    msg = error_of(tmp_path, "model:\n  hidden_size: 64\nmodel:\n  num_layers: 2\n")
    assert "duplicate key 'model'" in msg and "line 3" in msg and "first at line 1" in msg


def test_top_level_must_be_a_mapping(tmp_path):
    msg = error_of(tmp_path, "- model\n- optimizer\n")
    assert "top level must be a mapping" in msg and "['model', 'optimizer'] (list)" in msg


# ---- unknown keys ------------------------------------------------------------------------------

def test_unknown_top_level_key_suggests_section(tmp_path):
    msg = error_of(tmp_path, "modle:\n  hidden_size: 64\n")
    assert "modle: unknown key; did you mean 'model'?" in msg
    assert "allowed top-level keys: general, parallelism, model, tokenizer" in msg


def test_unknown_nested_key_names_full_path_and_allowed_keys(tmp_path):
    msg = error_of(tmp_path, "model:\n  hiden_size: 64\n")
    assert "model.hiden_size: unknown key; did you mean 'hidden_size'?" in msg
    assert "allowed keys in section model: vocab_size, hidden_size, ffn_size" in msg

    msg = error_of(tmp_path, "model:\n  low_rank:\n    rnak: 8\n")
    assert "model.low_rank.rnak: unknown key; did you mean 'rank'?" in msg
    assert "allowed keys in section model.low_rank: kind, rank, targets" in msg


def test_unknown_key_without_close_match_lists_allowed_keys(tmp_path):
    msg = error_of(tmp_path, "tokens:\n  zzz: 1\n")
    assert "tokens.zzz: unknown key" in msg and "did you mean" not in msg
    assert "allowed keys in section tokens: sequence_length, micro_batch_size" in msg


# ---- types -------------------------------------------------------------------------------------

@pytest.mark.parametrize("yaml_text, expected", [
    ("model:\n  hidden_size: '128'\n", "model.hidden_size: expected int, got '128' (str)"),
    ("model:\n  num_layers: 2.5\n", "model.num_layers: expected int, got 2.5 (float)"),
    ("optimizer:\n  lr: fast\n", "optimizer.lr: expected float, got 'fast' (str)"),
    ("model:\n  qk_norm: 1\n", "model.qk_norm: expected bool, got 1 (int)"),
    ("optimizer:\n  name: sgd\n", "optimizer.name: expected one of 'adamw', 'muon', got 'sgd' (str)"),
    ("general:\n  run: 2024\n", "general.run: expected str, got 2024 (int) (quote it in YAML"),
    ("optimizer:\n  betas: 0.9\n", "optimizer.betas: expected list of float, got 0.9 (float)"),
    ("data:\n  source: jsonl\n  paths: [a.jsonl, 7]\n", "data.paths[1]: expected str, got 7 (int)"),
    ("parallelism:\n  layers_per_stage: 4\n",
     "parallelism.layers_per_stage: expected optional list of int, got 4 (int)"),
    ("logging:\n  peak_tflops: lots\n", "logging.peak_tflops: expected optional float, got 'lots' (str)"),
    ("parallelism:\n  link:\n    per_stage_pair: [0, 1]\n",
     "parallelism.link.per_stage_pair: expected mapping of str to mapping of str to float, got [0, 1] (list)"),
    ("parallelism:\n  link:\n    per_stage_pair:\n      0-1: {latency_ms: slow}\n",
     "parallelism.link.per_stage_pair.0-1.latency_ms: expected float, got 'slow' (str)"),
    ("parallelism:\n  link:\n    per_stage_pair:\n      0-1: 5\n",
     "parallelism.link.per_stage_pair.0-1: expected mapping of str to float, got 5 (int)"),
    ("parallelism:\n  link:\n    per_stage_pair:\n      7: {latency_ms: 1}\n",
     "parallelism.link.per_stage_pair: keys must be str, got key 7 (int)"),
])
def test_wrong_type_names_path_expected_type_and_value(tmp_path, yaml_text, expected):
    assert expected in error_of(tmp_path, yaml_text)


@pytest.mark.parametrize("key", ["num_layers", "hidden_size"])
def test_bool_is_not_an_int(tmp_path, key):
    msg = error_of(tmp_path, f"model:\n  {key}: true\n")
    assert f"model.{key}: expected int, got true (bool)" in msg


def test_bool_is_not_a_float(tmp_path):
    assert "optimizer.lr: expected float, got false (bool)" in error_of(tmp_path, "optimizer:\n  lr: false\n")


def test_int_is_accepted_for_float_and_stored_as_float(tmp_path):
    cfg = load_config(write(tmp_path, """
        optimizer: {lr: 1, betas: [0, 0.5]}
        parallelism: {pp: 2, link: {per_stage_pair: {"0-1": {bandwidth_mbps: 80, latency_ms: 5}}}}
    """))
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float
    assert [type(b) for b in cfg.optimizer.betas] == [float, float]
    assert cfg.parallelism.link.per_stage_pair == {"0-1": {"bandwidth_mbps": 80.0, "latency_ms": 5.0}}
    assert type(cfg.parallelism.link.per_stage_pair["0-1"]["latency_ms"]) is float


def test_exponent_floats_without_dot_load_as_floats(tmp_path):
    # YAML 1.1 (PyYAML) reads these as strings; a float field must still take them.
    cfg = load_config(write(tmp_path, "optimizer:\n  lr: 3e-4\n  eps: 1e-8\nmodel:\n  rope_theta: 1.0e5\n"))
    assert (cfg.optimizer.lr, cfg.optimizer.eps, cfg.model.rope_theta) == (3e-4, 1e-8, 1e5)
    # A dict from plain yaml.safe_load still holds the string; the builder accepts exactly that form.
    raw = yaml.safe_load("lr: 3e-4")
    assert raw == {"lr": "3e-4"}
    assert from_dict(Config, {"optimizer": raw}).optimizer.lr == 3e-4


def test_section_that_is_not_a_mapping_is_named(tmp_path):
    assert "model: expected a mapping (section), got 3 (int)" in error_of(tmp_path, "model: 3\n")
    msg = error_of(tmp_path, "model:\n  low_rank: [svd]\n")
    assert "model.low_rank: expected a mapping (section), got ['svd'] (list)" in msg


# ---- generic builder: required fields ----------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _Inner:
    name: str
    size: int = 1


@dataclasses.dataclass(kw_only=True)
class _Outer:
    inner: _Inner
    tags: list[str] = dataclasses.field(default_factory=list)


def test_missing_required_field_is_named():
    with pytest.raises(ConfigError) as exc:
        from_dict(_Inner, {"size": 2}, path="job")
    assert "missing required key in section job: job.name" in str(exc.value)

    with pytest.raises(ConfigError) as exc:
        from_dict(_Outer, {"inner": {}})
    assert "missing required key in section inner: inner.name" in str(exc.value)

    with pytest.raises(ConfigError) as exc:
        from_dict(_Outer, {})
    assert "missing required key in the top level: inner" in str(exc.value)

    built = from_dict(_Outer, {"inner": {"name": "x"}, "tags": ["a"]})
    assert built == _Outer(inner=_Inner(name="x"), tags=["a"])


# ---- validation inside the dataclasses ---------------------------------------------------------

def test_post_init_error_propagates_unchanged(tmp_path):
    with pytest.raises(ConfigError) as direct:
        ModelConfig(num_heads=3)
    with pytest.raises(ConfigError) as loaded:
        load_config(write(tmp_path, "model:\n  num_heads: 3\n"))
    assert type(loaded.value) is ConfigError
    assert str(loaded.value) == str(direct.value) == "model.hidden_size: 128 is not divisible by model.num_heads=3"


def test_cross_section_check_runs_on_load(tmp_path):
    msg = error_of(tmp_path, "tokens:\n  sequence_length: 1024\n")
    assert msg == "tokens.sequence_length: 1024 exceeds model.max_seq_len=512"


def test_validate_world_size_names_the_numbers():
    cfg = Config()
    with pytest.raises(ConfigError) as exc:
        cfg.validate(world_size=3)
    assert "world size 3" in str(exc.value) and "1 * 1 * 1 = 1" in str(exc.value)
    cfg.validate(world_size=1)


# ---- overrides ---------------------------------------------------------------------------------

def test_overrides_parse_values_as_yaml(tmp_path):
    path = write(tmp_path, "optimizer:\n  lr: 0.01\nparallelism:\n  pp: 2\n")
    cfg = load_config(path, [
        "optimizer.lr=3e-4",
        "optimizer.betas=[0.8, 0.9]",
        "model.qk_norm=true",
        "parallelism.layers_per_stage=[1,3]",
        "parallelism.link.per_stage_pair.0-1.latency_ms=5",
        "tokens.train_steps=7",
        "tokens.train_steps=9",  # later wins
        "general.run=2024",  # text field: kept as written, not an int
        "data.text_key=yes",  # not YAML 1.1's `true`
    ])
    assert cfg.optimizer.lr == 3e-4 and type(cfg.optimizer.lr) is float
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.model.qk_norm is True
    assert cfg.parallelism.pp == 2 and cfg.parallelism.layers_per_stage == [1, 3]
    assert cfg.parallelism.link.per_stage_pair == {"0-1": {"latency_ms": 5.0}}
    assert cfg.tokens.train_steps == 9
    assert cfg.general.run == "2024" and cfg.data.text_key == "yes"


def test_override_value_is_type_checked():
    with pytest.raises(ConfigError) as exc:
        from_dict(Config, apply_overrides(None, ["model.num_layers=many"]))
    assert "model.num_layers: expected int, got 'many' (str)" in str(exc.value)


def test_unknown_override_path_fails_like_unknown_yaml_key(tmp_path):
    from_yaml = error_of(tmp_path, "model:\n  hiden_size: 64\n")
    from_override = error_of(tmp_path, "", ["model.hiden_size=64"])
    assert from_override == from_yaml
    assert "model.hiden_size: unknown key; did you mean 'hidden_size'?" in from_override
    assert "modle: unknown key; did you mean 'model'?" in error_of(tmp_path, "", ["modle.hidden_size=64"])


def test_override_below_a_scalar_key_is_named(tmp_path):
    msg = error_of(tmp_path, "", ["optimizer.lr.peak=1"])
    assert msg == "override 'optimizer.lr.peak=1': optimizer.lr is float, it has no key 'peak'"


@pytest.mark.parametrize("bad, expected", [
    ("optimizer.lr", "override 'optimizer.lr' has no '='"),
    ("=3", "override '=3': '' is not a dotted key"),
    ("optimizer..lr=3", "override 'optimizer..lr=3': 'optimizer..lr' is not a dotted key"),
    ("optimizer.betas=[0.9", "override 'optimizer.betas=[0.9': value is not valid YAML"),
])
def test_malformed_override_is_named(bad, expected):
    with pytest.raises(ConfigError) as exc:
        apply_overrides({}, [bad])
    assert expected in str(exc.value)


def test_apply_overrides_does_not_mutate_input():
    data = {"model": {"hidden_size": 64}}
    out = apply_overrides(data, ["model.hidden_size=32"])
    assert data == {"model": {"hidden_size": 64}} and out == {"model": {"hidden_size": 32}}


# ---- saving ------------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    original = load_config(write(tmp_path, """
        general: {run: "1e3", seed: 7}
        parallelism:
          pp: 2
          layers_per_stage: [3, 1]
          link: {enabled: true, per_stage_pair: {"0-1": {bandwidth_mbps: 80, latency_ms: 5}}}
        model: {low_rank: {kind: svd, rank: 16, targets: [q, k]}, tp_strategy: btp, boost: {rmsnorm: sync}}
        optimizer: {name: muon, lr: 3e-4, eps: 1e-10}
        data: {source: jsonl, paths: [a.jsonl, b.jsonl]}
        logging: {peak_tflops: 989.5}
    """))
    out = tmp_path / "runs" / "r1" / "config.yaml"
    save_config(original, out)
    assert load_config(out) == original
    assert config_to_dict(load_config(out)) == config_to_dict(original)
    text = out.read_text()
    assert "run: '1e3'" in text  # quoted, or it would read back as the float 1000.0
    assert text.index("general:") < text.index("parallelism:") < text.index("model:")  # schema order
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_save_replaces_existing_file(tmp_path):
    out = tmp_path / "config.yaml"
    out.write_text("stale: true\n")
    save_config(Config(), out)
    assert load_config(out) == Config()


# ---- argparse and CLI --------------------------------------------------------------------------

def test_config_args(tmp_path):
    path = write(tmp_path, "tokens:\n  train_steps: 5\n")
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--config-file", str(path),
                              "--set", "optimizer.lr=3e-4", "--set", "tokens.val_steps=2"])
    cfg = config_from_args(args)
    assert (cfg.tokens.train_steps, cfg.tokens.val_steps, cfg.optimizer.lr) == (5, 2, 3e-4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--set", "optimizer.lr=1"])  # --config-file is required


def test_describe_reads_field_docstrings():
    rows = {name: (tp, doc) for name, tp, doc in describe(ModelConfig)}
    assert rows["hidden_size"] == ("int", "Model width d.")
    assert rows["dtype"][0] == "one of 'fp32', 'bf16'"
    assert rows["low_rank"] == ("section", "Low-rank factorisation of the attention and MLP linears (BOOST paper).")
    # technique sections mounted under model are keys of the section like core ones
    assert [r[0] for r in describe(ModelConfig)] == [f.name for f in dataclasses.fields(ModelConfig())]
    doc = {n: d for n, _, d in describe(ModelConfig)}["tp_strategy"]
    assert doc.startswith("How tensor parallelism splits the model: megatron")
    doc = {n: d for n, _, d in describe(BoostConfig)}["rmsnorm"]
    assert doc.startswith("Norms inside a BTP chunk")
    assert {n: t for n, t, _ in describe(ParallelismConfig)}["layers_per_stage"] == "optional list of int"
    link_types = {n: t for n, t, _ in describe(LinkConfig)}
    assert link_types["per_stage_pair"] == "mapping of str to mapping of str to float"


def test_doc_lists_every_section_and_field():
    text = render_doc(width=100)
    for section in ("general", "parallelism", "parallelism.link", "model", "model.low_rank", "model.boost",
                    "model.codec", "tokenizer", "tokens", "optimizer", "data", "checkpoints", "logging"):
        assert f"[{section}]" in text
    for path, cls in _sections(Config):
        block = text.split(f"\n[{path}]", 1)[1].split("\n[", 1)[0]
        for name, type_text, _ in describe(cls):
            assert f"\n  {name} " in block and type_text in block, (path, name)
    assert "[0.9, 0.95]" in text and "optional float" in text and "Peak learning rate of the Muon" in text


def test_config_doc_says_what_every_unset_default_resolves_to() -> None:
    # `kind: resbm` alone resolved model.codec.resbm.ratio to 4 while `config doc` said null (and `m: 8` alone lost
    # the 4: "give exactly one of h and ratio"); every key whose resolved default differs from the doc's default
    # column must say what it resolves to ("Unset: ...")
    import dataclasses

    from nanotron_ext.config.__main__ import _default_text
    from nanotron_ext.config.compose import composed
    from nanotron_ext.config.loader import apply_overrides, describe, from_dict
    from nanotron_ext.config.yaml_io import dump_yaml

    cfg = from_dict(Config, apply_overrides({}, []))
    for path, cls in _sections(Config):
        section = cfg
        for part in path.split("."):
            section = getattr(section, part)
        docs = {name: doc for name, _, doc in describe(cls)}
        for f in dataclasses.fields(composed(cls)):
            value = getattr(section, f.name)
            if not f.init or dataclasses.is_dataclass(value):
                continue
            resolved = dump_yaml(value, flow=True).removesuffix("...\n").strip()
            if resolved != _default_text(f):
                assert "unset" in docs[f.name].lower(), (path, f.name, resolved, _default_text(f), docs[f.name])
    assert "Unset with h unset too: 4" in " ".join(docs_of("model.codec.resbm", "ratio").split())
    tiny = REPO / "examples" / "config_tiny_llama.yaml"
    sets = ["model.codec.kind=resbm", "model.codec.boundaries=every_layer"]
    assert load_config(tiny, sets).model.codec.resbm.ratio == 4
    assert load_config(tiny, sets + ["model.codec.resbm.m=8"]).model.codec.resbm.ratio == 4
    resbm = load_config(tiny, sets + ["model.codec.resbm.h=8"]).model.codec.resbm
    assert (resbm.h, resbm.ratio) == (8, None)


def docs_of(path: str, key: str) -> str:
    from nanotron_ext.config.loader import describe

    return {name: doc for name, _, doc in describe(dict(_sections(Config))[path])}[key]


def test_show_prints_resolved_yaml(tmp_path, capsys):
    path = write(tmp_path, "model:\n  num_layers: 2\n")
    assert config_cli(["show", "--config-file", str(path), "--set", "optimizer.lr=3e-4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["num_layers"] == 2 and shown["optimizer"]["lr"] == 3e-4
    assert shown["tokens"] == config_to_dict(Config())["tokens"]

    assert config_cli(["show", "--set", "model.hiden_size=3"]) == 2
    assert "model.hiden_size: unknown key; did you mean 'hidden_size'?" in capsys.readouterr().err


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "doc"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[model.low_rank]" in out.stdout and "hidden_size" in out.stdout


# ---------------------------------------------------------------- hardening (issue 12)


@pytest.mark.parametrize("override, expected", [
    ("model.rope_theta=0", "model.rope_theta: must be > 0"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps: must be > 0"),
    ("model.init_std=-0.02", "model.init_std: must be > 0"),
    ("optimizer.lr=.inf", "optimizer.lr: must be a finite number, got inf"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: must be >= 0"),
    ("optimizer.muon_momentum=1.0", "optimizer.muon_momentum: must be in [0, 1)"),
    ("optimizer.eps=0", "optimizer.eps: must be > 0"),
    ("optimizer.clip_grad=.nan", "optimizer.clip_grad: must be a finite number"),
    ("logging.peak_tflops=0", "logging.peak_tflops: must be a number > 0"),
])
def test_values_that_give_a_non_finite_loss_are_rejected(tmp_path, override, expected):
    # case 3 (config side): these used to pass validation and train on NaN
    assert expected in error_of(tmp_path, "", [override])


@pytest.mark.parametrize("run", ["/tmp/elsewhere", "../sibling", "a/../../b", "", "..\\\\up"])
def test_run_name_cannot_leave_output_dir(tmp_path, run):
    # case 6: general.run was joined to general.output_dir unchecked
    assert "general.run: " in error_of(tmp_path, "", [f"general.run={run!r}" if run else "general.run=''"])


def test_atomic_writes_get_ordinary_file_permissions(tmp_path) -> None:
    import os
    import stat

    from nanotron_ext.fileio import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert (tmp_path / "a.txt").read_text() == "x" and not list(tmp_path.glob(".a.txt.*"))


def test_1f1b_needs_enough_micro_batches_for_the_pipeline() -> None:
    # nanotron's engine asserted this only once training started, on one rank, inside a traceback
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config, ConfigError

    with pytest.raises(ConfigError, match=r"tokens.batch_accumulation_per_replica: 1 micro-batches cannot fill a 1F1B"):
        from_dict(Config, {"parallelism": {"pp": 4}, "tokens": {"batch_accumulation_per_replica": 1}})
    from_dict(Config, {"parallelism": {"pp": 4, "pp_engine": "afab"}, "tokens": {"batch_accumulation_per_replica": 1}})
    from_dict(Config, {"parallelism": {"pp": 4}, "tokens": {"batch_accumulation_per_replica": 3}})


def _modules_after(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


HEAVY = ("torch", "nanotron")


def _technique_packages() -> list:
    """The in-tree technique packages, from the installed entry points the registry loads (nanotron_ext.registry),
    the core's own (nanotron_ext.models) aside: a sixth declared in pyproject.toml joins without editing this test."""
    import importlib.metadata

    from nanotron_ext.registry import ENTRY_POINT_GROUP

    return sorted(ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                  if ep.value.startswith("nanotron_ext.") and ep.name != "core")


TECHNIQUES = _technique_packages()  # e.g. nanotron_ext.boost


def test_importing_the_schema_imports_no_technique_no_torch_and_no_nanotron():
    loaded = _modules_after("from nanotron_ext.config.schema import Config")
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]
    assert TECHNIQUES and not [m for m in loaded if m.startswith(tuple(TECHNIQUES))]


def test_loading_a_config_with_every_technique_section_imports_no_torch():
    """Technique sections and names are declared light: a config that uses every technique loads (and its
    names are checked) without torch or nanotron; only the technique packages' declarations are imported."""
    code = ("from nanotron_ext.config import load_config\n"
            "c = load_config('examples/config_tiny_het_sparseloco.yaml', ['model.low_rank.kind=svd', "
            "'model.tp_strategy=btp', 'model.codec.resbm.ratio=8', 'model.codec.mapl.rank=16', "
            "'optimizer.spel.momentum=0.5'])\n"
            "assert c.model.tp_strategy == 'btp' and c.sparseloco.compressed_replicas == [0]")
    loaded = _modules_after(code)
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]
    assert len(TECHNIQUES) >= 5
    for t in TECHNIQUES:
        assert f"{t}.technique" in loaded and f"{t}.pieces" not in loaded
