"""`model.init_from: hf:DIR`: a tiny Llama made and saved by transformers (random init, no hub) starts a run at
tp=2 x pp=2 whose first loss is transformers' loss on the same batch, and after one step at a learning rate
too small to move an fp32 weight it exports back to the very same tensors. Factorised targets start from a
truncated SVD whose reported error is the Eckart-Young closed form; Subspace Models report the part outside
span(U); a folder that does not match the model section fails at config load naming the key."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.runs import TINY, VOCAB, corpus_overrides, prepare_corpus, run_overrides, write_corpus

pytest.importorskip("transformers")

HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
          tie_word_embeddings=False)
MODEL = ["model.vocab_size=320", "model.hidden_size=32", "model.ffn_size=64", "model.num_layers=4", "model.num_heads=4",
         "model.num_kv_heads=2", "model.max_seq_len=64", "model.tie_embeddings=false", "tokens.sequence_length=16"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf_tiny_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(str(folder), safe_serialization=True)
    return folder


def _hf_state(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_import_trains_one_step_at_tp2_pp2_and_exports_back_unchanged(hf_folder: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.loader import build_train_loader
    from nanotron_ext.export import export
    from nanotron_ext.metrics.logger import read_metrics
    from tests.helpers.runs import train_worker

    write_corpus(tmp_path / "corpus.jsonl")
    base = corpus_overrides(tmp_path / "corpus.jsonl", tmp_path / "prepared")
    prepare_corpus(base)
    # lr 1e-30: one real step (forward, backward, AdamW) whose update, ~1e-30 per weight, is far below the spacing
    # of fp32 numbers near these weights (>= 1e-12), so every weight is unchanged (lr must be > 0)
    overrides = run_overrides(base, tmp_path / "out", 2, 2, steps=1) + [f"model.init_from=hf:{hf_folder}",
                                                                         "optimizer.lr=1e-30", "tokens.val_steps=1"]
    run_distributed(train_worker, 4, overrides)

    folder = export(str(tmp_path / "out" / "run"), str(tmp_path / "back"))
    before, after = _hf_state(hf_folder), _hf_state(folder)
    assert sorted(before) == sorted(after)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, changed

    # the run's first loss is transformers' loss of the same first micro-batch
    cfg = load_config(TINY, overrides)
    batch = next(build_train_loader(cfg, dp_rank=0, dp_size=1))
    model = LlamaForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["label_ids"].flatten()).item()
    first = read_metrics(tmp_path / "out" / "run" / "metrics.jsonl")[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-5)


def _import_worker(overrides: List[str]) -> dict:
    """Build the model with init_from at tp=2 (as build_model does, keeping what the import reports); return the
    report and the model's dense equivalent."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.models.dense import dense_state_dict
    from nanotron_ext.models.init import init_weights_
    from nanotron_ext.models.init_from import load_init_from_
    from nanotron_ext.models.llama import LlamaForTraining
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.parallel.p2p import AccountedP2P

    cfg = load_config(TINY, overrides)
    ctx = build_parallel_context(1, 2, 1, backend="gloo")
    model = LlamaForTraining(cfg.model, ctx, AccountedP2P(ctx.pp_pg, device=ctx.device))
    init_weights_(model, seed=cfg.general.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    imported = load_init_from_(model, cfg.model)
    model.apply_constraints()
    report = imported.report(model, cfg.model, ctx)
    hub = {}
    if cfg.model.embedding.kind == "subspace":
        from nanotron_ext.subspace.pieces import hub_of

        h = hub_of(model)
        hub = {"basis": h.basis.clone(), "fixed": h.fixed.clone()}
    return {"report": report, "dense": dense_state_dict(model, ctx.tp_pg, exact=False), **hub}


LOW_RANK = ["model.low_rank.kind=svd", "model.low_rank.rank=8"]
SUBSPACE = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
            "model.subspace.k=8", "parallelism.pp=1", "model.codec.boundaries=every_layer"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["vanilla", "btp"])
def test_low_rank_targets_start_from_the_truncated_svd(hf_folder: Path, strategy: str) -> None:
    r = 8
    overrides = MODEL + LOW_RANK + [f"model.tp_strategy={strategy}", "parallelism.tp=2", "parallelism.dp=1",
                                    f"model.init_from=hf:{hf_folder}", "tokenizer.vocab_size=300"]
    out = run_distributed(_import_worker, 2, overrides)[0]
    hf = _hf_state(hf_folder)
    checked = 0
    for name, w in hf.items():
        if not name.endswith("_proj.weight"):
            assert out["report"][_ours(name)] == 0.0, name  # copied as is
            continue
        s = torch.linalg.svdvals(w.double())
        closed_form = (s[r:].pow(2).sum().sqrt() / s.pow(2).sum().sqrt()).item()  # Eckart-Young
        ours = _ours(name)
        assert out["report"][ours] == pytest.approx(closed_form, rel=1e-4), name
        u, sv, vh = torch.linalg.svd(w.double(), full_matrices=False)
        best = (u[:, :r] * sv[:r]) @ vh[:r]
        assert (out["dense"][ours].double() - best).abs().max().item() < 1e-5, name
        checked += 1
    assert checked == 4 * 7


@pytest.mark.slow
def test_subspace_models_report_what_span_u_loses(hf_folder: Path) -> None:
    overrides = MODEL + SUBSPACE + ["parallelism.tp=2", "parallelism.dp=1", f"model.init_from=hf:{hf_folder}",
                                    "tokenizer.vocab_size=300"]
    out = run_distributed(_import_worker, 2, overrides)[0]
    hf = _hf_state(hf_folder)
    u = out["basis"].double()
    proj = torch.eye(u.shape[0], dtype=torch.float64) - u @ u.T
    e = hf["model.embed_tokens.weight"].double()
    expected = ((e - out["fixed"].double()) @ proj).norm() / e.norm()
    assert out["report"]["token_embedding.pp_block.embedding.weight"] == pytest.approx(expected.item(), rel=1e-5)
    for i in range(3):  # every block but the last writes into span(U)
        for hf_name, ours in (("self_attn.o_proj", "attn.o_proj"), ("mlp.down_proj", "mlp.down_proj")):
            w = hf[f"model.layers.{i}.{hf_name}.weight"].double()
            assert out["report"][f"decoder.{i}.pp_block.{ours}.weight"] == pytest.approx(
                ((proj @ w).norm() / w.norm()).item(), rel=1e-5)
    assert out["report"]["decoder.3.pp_block.mlp.down_proj.weight"] == 0.0


def _ours(hf_name: str) -> str:
    from nanotron_ext.hf.names import from_hf_name

    return from_hf_name(hf_name)


def test_a_folder_that_does_not_match_fails_when_the_job_starts(hf_folder: Path, tmp_path: Path) -> None:
    """The folder is checked when the job starts, before any process group (issue 32: not at config load)."""
    from nanotron_ext.config.checks import ConfigError
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.__main__ import check_job_start

    def start(overrides: List[str]) -> None:
        check_job_start(load_config(TINY, overrides))

    good = MODEL + [f"model.init_from=hf:{hf_folder}", "tokenizer.vocab_size=300"]
    start(good)
    with pytest.raises(ConfigError, match=r"model.hidden_size=64 but .*config.json has hidden_size=32; set "
                                          r"model.hidden_size: 32"):
        start(good + ["model.hidden_size=64"])
    with pytest.raises(ConfigError, match="model.tie_embeddings=true but .* has a head of its own"):
        start(good + ["model.tie_embeddings=true"])
    tied = tmp_path / "tied"
    tied.mkdir()
    cfg = json.loads((hf_folder / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    (tied / "model.safetensors").symlink_to(hf_folder / "model.safetensors")  # its tensors are checked at start too
    start(MODEL + [f"model.init_from=hf:{tied}", "tokenizer.vocab_size=300"])  # untied head = a copy
    with pytest.raises(ConfigError, match="model.qk_norm=True but .* holds a llama model"):
        start(good + ["model.qk_norm=true"])
    with pytest.raises(ConfigError, match="expected 'hf:DIR'"):
        start(MODEL + [f"model.init_from={hf_folder}", "tokenizer.vocab_size=300"])
    with pytest.raises(ConfigError, match="is not a folder"):
        start(MODEL + [f"model.init_from=hf:{tmp_path / 'missing'}", "tokenizer.vocab_size=300"])
    bad = tmp_path / "scaled"
    bad.mkdir()
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": scaled, "rope_scaling": scaled}))
    with pytest.raises(ConfigError, match="scaled RoPE"):
        start(MODEL + [f"model.init_from=hf:{bad}", "tokenizer.vocab_size=300"])
