"""After training, out of the project: runs trained at dp=1 x tp=2 x pp=2 (full rank; BOOST SVD under btp; Subspace
Models in both parameterisations) and at tp=2 with qk-norm and a tied head export to folders that transformers
loads; their logits equal the logits of the model in its training layout (computed by the trainer's processes
from the trainer's own checkpoint loader, not by the export code) within 1e-5 in fp32, and greedy generation
gives the same tokens. `eval` reproduces the trainer's validation loss; models without a dense equivalent are
refused in one line while generate still runs them."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.extras import require
from tests.helpers.runs import REPO, corpus_overrides, prepare_corpus, run_overrides, write_corpus

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

EOS = 0  # <|endoftext|>, the first special token of the trained BPE
PROMPT = [EOS, 40, 41, 72, 101, 32, 67]  # the separator as BOS, then a few ids
NEW_TOKENS = 8
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
      "model.subspace.k=8"]
VARIANTS: Dict[str, tuple] = {  # name -> (tp, pp, overrides)
    "full_rank": (2, 2, ["tokens.val_steps=100000"]),  # validation over every window: the eval test's reference
    "svd_btp": (2, 2, ["model.low_rank.kind=svd", "model.low_rank.rank=8", "model.tp_strategy=btp"]),
    "sm_reparam": (2, 2, SM + ["model.subspace.parameterisation=reparam"]),
    "sm_projection": (2, 2, SM + ["model.subspace.parameterisation=projection"]),
    "qk_norm_tied": (2, 1, ["model.qk_norm=true", "model.tie_embeddings=true"]),
}
REFUSED = {"cola": (1, 1, ["model.low_rank.kind=cola", "model.low_rank.rank=8", "model.tp_strategy=vanilla"])}


def _check_ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


def _train_and_look(overrides: List[str], ids: torch.Tensor, prompt: List[int], new_tokens: int) -> dict:
    """Train, then (same processes, the trainer's model) logits of `ids` and a greedy continuation of `prompt`,
    through the pipeline as trained; returned by the last stage's TP rank 0."""
    import torch.distributed as torch_dist
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    from nanotron_ext.config.loader import load_config
    from nanotron_ext.train.trainer import Trainer
    from tests.helpers.runs import TINY

    trainer = Trainer(load_config(TINY, overrides))
    trainer.train()
    model, ctx = trainer.replica.model, trainer.ctx
    pp, pp_rank = ctx.pp_pg.size(), torch_dist.get_rank(ctx.pp_pg)
    last = pp_rank == pp - 1

    @torch.no_grad()
    def full_logits(x: torch.Tensor):
        sharded = model.sharded_logits(x if pp_rank == 0 else TensorPointer(group_rank=0))
        if not last:
            return None
        shards = [torch.empty_like(sharded) for _ in range(ctx.tp_pg.size())]
        torch_dist.all_gather(shards, sharded.contiguous(), group=ctx.tp_pg)
        return torch.cat(shards, dim=-1)

    logits = full_logits(ids)
    seq = list(prompt)
    src = (pp - 1) * ctx.dp_pg.size() * ctx.tp_pg.size()  # last stage, dp 0, tp 0 (rank grid pp x dp x tp)
    for _ in range(new_tokens):
        out = full_logits(torch.tensor([seq]))
        token = torch.tensor([int(out[0, -1].argmax()) if last else 0])
        torch_dist.broadcast(token, src=src)
        seq.append(int(token))
        if int(token) == EOS:
            break
    return {"logits": logits, "greedy": seq[len(prompt):]} if last else {}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_corpus")
    docs = write_corpus(root / "corpus.jsonl")
    base = corpus_overrides(root / "corpus.jsonl", root / "prepared")
    prepare_corpus(base)
    return {"root": root, "docs": docs, "base": base}


_TRAINED: Dict[str, dict] = {}


def _trained(name: str, corpus: dict) -> dict:
    if name not in _TRAINED:
        tp, pp, extra = {**VARIANTS, **REFUSED}[name]
        out = corpus["root"] / name
        overrides = run_overrides(corpus["base"], out, tp, pp) + ["tokens.val_steps=1"] + extra
        results = run_distributed(_train_and_look, tp * pp, overrides, _check_ids(), PROMPT, NEW_TOKENS)
        seen = next(r for r in results if r)
        _TRAINED[name] = {"run": out / "run", "out": out, **seen}
    return _TRAINED[name]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers_with_the_same_logits_and_greedy_tokens(name: str, corpus: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanotron_ext.export import export

    run = _trained(name, corpus)
    folder = export(str(run["run"]), str(run["out"] / "hf"))
    info = json.loads((folder / "nanotron_ext_export.json").read_text())
    assert info["check"]["max_abs_logit_diff"] <= 1e-5, info["check"]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(model).__name__ == ("Qwen3ForCausalLM" if "qk_norm" in name else "LlamaForCausalLM")
    with torch.no_grad():
        theirs = model(input_ids=_check_ids()).logits
    diff = (theirs - run["logits"]).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logit difference| {diff:.3g}"
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0,
                                                                                                len(PROMPT):].tolist()
    assert greedy == run["greedy"], (greedy, run["greedy"])

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(corpus["root"] / "prepared" / "tokenizer.json"))
    text = corpus["docs"][0][:200]
    assert tokenizer(text).input_ids == ours.encode(text).ids  # nothing added: our documents have no BOS
    eos = ours.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == eos == model.config.eos_token_id


def test_eval_equals_the_trainers_validation_loss(corpus: dict, tmp_path: Path) -> None:
    """The run's validation documents, in order, as a jsonl: eval's loss is the trainer's validation loss (every
    window: micro-batch 1, val_steps beyond the split); bits per byte follow from tokens and bytes counted here."""
    from nanotron_ext.data.prepare import validation_indices
    from nanotron_ext.eval import main as eval_main
    from nanotron_ext.metrics.logger import read_metrics

    run = _trained("full_rank", corpus)
    docs = corpus["docs"]
    val = sorted(validation_indices(len(docs), 42, 0.2))
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": docs[i]}) + "\n" for i in val))
    out = tmp_path / "eval.json"
    assert eval_main(["--run", str(run["run"]), "--data", str(data), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    trainer_val = [r["val_loss"] for r in read_metrics(run["run"] / "metrics.jsonl") if "val_loss" in r][-1]
    assert got["loss"] == pytest.approx(trainer_val, rel=1e-5, abs=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(trainer_val), rel=1e-5)
    manifest = json.loads((corpus["root"] / "prepared" / "manifest.json").read_text())
    assert got["tokens"] == manifest["splits"]["validation"]["tokens"]
    n_bytes = sum(len(docs[i].encode("utf-8")) for i in val)
    assert got["bytes"] == n_bytes
    assert got["bits_per_byte"] == pytest.approx(trainer_val * got["tokens"] / n_bytes / math.log(2), rel=1e-6)


def _cli(module: str, args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_cola_is_refused_in_one_line_and_generates_natively(corpus: dict) -> None:
    """CoLA (y = A silu(Bx)) has no dense equivalent: export exits 2 with one line naming why; generate falls back
    to our own model, and its greedy tokens are the trained layout's."""
    run = _trained("cola", corpus)
    proc = _cli("nanotron_ext.export", ["--run", str(run["run"]), "--out", str(run["out"] / "hf")])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "cola or lax" in proc.stderr, proc.stderr
    assert not (run["out"] / "hf").exists()

    from nanotron_ext.data.prepare import load_tokenizer

    tok = load_tokenizer(corpus["root"] / "prepared" / "tokenizer.json")
    prompt = "The Congress"
    gen = _cli("nanotron_ext.generate", ["--run", str(run["run"]), "--prompt", prompt, "--temperature", "0",
                                         "--max-new-tokens", str(NEW_TOKENS)])
    assert gen.returncode == 0, gen.stderr
    assert "native, no cache" in gen.stderr
    expected = run_distributed(_greedy_from_checkpoint, 1, run["run"], [EOS] + tok.encode(prompt).ids)[0]
    assert gen.stdout.rstrip("\n") == prompt + tok.decode([t for t in expected if t != EOS])


def _greedy_from_checkpoint(run: Path, prompt: List[int]) -> List[int]:
    """Greedy continuation by the finished run's model in its own (one-process) layout, from its checkpoint."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.inference.model import logits
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.checkpoint import latest_checkpoint, load_checkpoint

    cfg = load_config(Path(run) / "config.yaml")
    ctx = build_parallel_context(1, 1, 1, backend="gloo")
    model = build_model(cfg, ctx)
    load_checkpoint(latest_checkpoint(cfg.checkpoints.dir), ctx, model=model)
    seq = list(prompt)
    for _ in range(NEW_TOKENS):
        token = int(logits(model, torch.tensor([seq]))[0, -1].argmax())
        seq.append(token)
        if token == EOS:
            break
    return seq[len(prompt):]


LM_EVAL_TASK = """task: nanotron_ext_local_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def test_lm_eval_reads_the_export_on_a_local_task(corpus: dict, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented path `lm_eval --model hf --model_args pretrained=DIR` on a task built from a local jsonl (no hub):
    its bits per byte agree with eval's on the same documents (not exactly: lm-eval scores each document alone with up
    to max_seq_len tokens of context, eval the trainer's 17-token windows over the stream, separators included)."""
    lm_eval = require("lm_eval", "eval")  # CI installs the eval extra: there this test runs, never skips
    from lm_eval.tasks import TaskManager

    from nanotron_ext.data.prepare import validation_indices
    from nanotron_ext.eval import main as eval_main
    from nanotron_ext.export import export

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = _trained("full_rank", corpus)
    folder = run["out"] / "hf"
    if not (folder / "config.json").exists():
        export(str(run["run"]), str(folder))
    docs = corpus["docs"]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": docs[i]}) + "\n"
                            for i in sorted(validation_indices(len(docs), 42, 0.2))))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text(LM_EVAL_TASK.format(data=data))
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32",
                                      tasks=["nanotron_ext_local_text"], device="cpu", batch_size=1,
                                      task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                               include_defaults=False))  # not lm-eval's ~20 s index
    theirs = results["results"]["nanotron_ext_local_text"]["bits_per_byte,none"]
    assert eval_main(["--run", str(run["run"]), "--data", str(data), "--json", str(tmp_path / "ours.json")]) == 0
    ours = json.loads((tmp_path / "ours.json").read_text())["bits_per_byte"]
    assert theirs == pytest.approx(ours, rel=0.02), (theirs, ours)


def test_the_one_process_model_equals_the_trained_layout(corpus: dict) -> None:
    """What generate --backend native and eval run: the checkpoint reassembled into one process, the codec kept where
    the pipeline had its boundary (Subspace Models trained at tp=2 x pp=2): the trained layout's logits."""
    run = _trained("sm_reparam", corpus)
    ours = run_distributed(_one_process_logits, 1, run["run"], _check_ids())[0]
    diff = (ours - run["logits"]).abs().max().item()
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g}"


def _one_process_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    from nanotron_ext.inference.model import load_single_process_model, logits, one_process_group
    from nanotron_ext.inference.run import gather, open_run

    ckpt = open_run(run)
    raw = gather(ckpt).raw
    with one_process_group():
        return logits(load_single_process_model(ckpt, raw), ids)


def test_a_one_process_layout_is_gathered_in_this_process_leaving_nothing_behind(corpus: dict) -> None:
    """eval, generate and export of a one-process run read its rank here (a spawned interpreter cost ~4 s of a 10 s
    eval): the same tensors as a spawned rank, and no process group, rank variable, random state, logging level,
    thread count or thread left behind."""
    run = _trained("cola", corpus)
    out = run_distributed(_gathered_here_and_spawned, 1, run["run"])[0]
    assert out["spawned_ranks"] == [0, 1]  # here, then (with a group of its own) spawned
    assert out["after"] == out["before"]
    here, spawned = out["here"], out["spawned"]
    assert sorted(here) == sorted(spawned) and all(torch.equal(here[k], spawned[k]) for k in here)


def _gathered_here_and_spawned(run: Path) -> dict:
    import logging

    import torch.distributed as torch_dist

    from nanotron_ext.inference.run import gather, open_run

    spawns = []
    real_spawn = torch.multiprocessing.spawn
    torch.multiprocessing.spawn = lambda *a, **k: spawns.append(1) or real_spawn(*a, **k)

    def state() -> dict:
        names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
        return {"group": torch_dist.is_initialized(), "rng": torch.get_rng_state().tolist(), "threads": names,
                "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
                "logging": logging.root.manager.disable, "intra_op": torch.get_num_threads()}

    ckpt = open_run(run)
    before = state()
    here = gather(ckpt).raw
    after, spawned_ranks = state(), [len(spawns)]
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    spawned = gather(ckpt).raw  # a process with a group of its own spawns the rank
    spawned_ranks.append(len(spawns))
    return {"here": here, "spawned": spawned, "before": before, "after": after, "spawned_ranks": spawned_ranks}


NO_DENSE = {  # overrides -> what the one-line refusal names
    "resbm": (["model.codec.kind=resbm", "model.codec.boundaries=every_layer"], "model.codec.kind='resbm'"),
    "int8": (["model.codec.kind=int8", "model.codec.boundaries=[1]"], "model.codec.kind='int8'"),
    "sm_drifting": (SM + ["model.codec.boundaries=every_layer", "model.subspace.parameterisation=projection",
                          "model.subspace.reproject=false"], "model.subspace.reproject=false"),
    "lax": (["model.low_rank.kind=lax", "model.low_rank.rank=8", "model.tp_strategy=vanilla"], "cola or lax"),
}


def _refusals(cases: Dict[str, List[str]]) -> Dict[str, str]:
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.models.build import build_model
    from nanotron_ext.models.dense import NoDenseEquivalent, dense_state_dict
    from nanotron_ext.parallel.context import build_parallel_context
    from tests.helpers.runs import TINY

    small = ["model.vocab_size=320", "model.hidden_size=32", "model.ffn_size=64", "model.max_seq_len=64",
             "tokenizer.vocab_size=300", "tokens.sequence_length=16", "parallelism.dp=1"]
    ctx = build_parallel_context(1, 1, 1, backend="gloo")
    out = {}
    for name, overrides in cases.items():
        model = build_model(load_config(TINY, small + overrides), ctx)
        try:
            dense_state_dict(model, ctx.tp_pg)
            out[name] = ""
        except NoDenseEquivalent as e:
            out[name] = str(e)
    return out


def test_models_without_a_dense_equivalent_say_why() -> None:
    got = run_distributed(_refusals, 1, {name: o for name, (o, _) in NO_DENSE.items()})[0]
    for name, (_, reason) in NO_DENSE.items():
        assert reason in got[name] and "\n" not in got[name], (name, got[name])
