"""`prepare`: documents -> train/validation split -> byte-level BPE -> datatrove token shards + manifest.

Every step is skipped when its output is already complete, and every output is written under a
temporary name and renamed into place, so an interrupted run never leaves something that looks
complete: the tokenizer file, each split folder (with its `split.json`) and, last, `manifest.json`.
"Complete" is checked, not assumed: a split is skipped only when its shards exist with the recorded sizes
(and, with `verify`, sha256s, which `split.json` and the manifest record per shard); prepare never deletes
a folder without our `split.json` and refuses a `prepared_dir` that overlaps an input path.
Documents are streamed (one pass to count, one per later step) instead of being held in memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import numpy as np
from datatrove.data import Document
from tqdm import tqdm

from nanotron_ext.config.schema import Config
from nanotron_ext.data.sources import DataError, iter_documents, source_fingerprint
from nanotron_ext.fileio import lock_folder, named, sha256_file, write_text_atomic

EOS_TOKEN = "<|endoftext|>"
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
SPLIT_INFO = "split.json"
FORMAT_VERSION = 1
_SPLIT_STREAM = 1  # SeedSequence tag: the document split draws from its own stream of general.seed


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OSError inside names `path` (what was being written) when it names no file of its own: a full disk's
    "[Errno 28] No space left on device" named none. The tokenizers library reports one as a bare Exception
    ("... (os error 28)"), made an OSError here."""
    try:
        yield
    except OSError as e:
        raise named(e, path) from e
    except Exception as e:  # noqa: BLE001 - only the OS errors tokenizers wraps are converted
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def read_manifest_file(out: Path, advice: str) -> dict:
    """The manifest of the prepared folder `out`, checked to hold what its readers use; a damaged one (garbage,
    binary, another JSON value, keys missing or of another type) is one DataError naming the file and the key,
    then `advice`."""
    from nanotron_ext.cli_checks import JsonFile

    f = JsonFile(out / MANIFEST, "the data manifest", DataError, advice, max_bytes=2**28)
    m = f.read_object()
    if m.get("format") != FORMAT_VERSION:  # (before the other keys: another format may name them otherwise)
        f.fail(f"has format {m.get('format')!r}, this code reads format {FORMAT_VERSION}")
    for key in ("vocab_size", "token_size", "documents"):
        f.need(m, key, int)
    f.need(m, "source", str)
    f.need(m, "settings", dict)
    tok = f.need(m, "tokenizer", dict)
    for key in ("path", "sha256"):
        f.need(tok, key, str, "tokenizer")
    for key in ("vocab_size", "eos_id"):
        f.need(tok, key, int, "tokenizer")
    splits = f.need(m, "splits", dict)
    for split in SPLITS:
        f.need(splits, split, dict, "splits")
        where = f"splits.{split}"
        for key in ("documents", "tokens", "max_token_id"):
            f.need(splits[split], key, int, where)
        f.need(splits[split], "files", list, where)
        f.table(splits[split], "shard_tokens", int, where)
        if splits[split].get("shard_sha256") is not None:
            f.table(splits[split], "shard_sha256", str, where)
    return m


def _write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def validation_indices(num_documents: int, seed: int, fraction: float) -> Set[int]:
    """Indices (in reading order) of the held-out documents: at least 1, and at least 1 left for training."""
    if num_documents < 2:
        raise DataError(f"need at least 2 documents (1 train + 1 validation), the source has {num_documents}")
    n_val = min(num_documents - 1, max(1, round(num_documents * fraction)))
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_STREAM]))
    return set(rng.permutation(num_documents)[:n_val].tolist())


def train_tokenizer(texts: Iterator[str], vocab_size: int, path: Path, *, length: Optional[int] = None,
                    show_progress: bool = True) -> None:
    """Train a byte-level BPE with `<|endoftext|>` (id 0) and save it atomically at `path`."""
    # datatrove / tokenizers only when preparing or reading data (seconds to import)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # unique: prepares may
    os.close(fd)  # share one tokenizer.path from different prepared_dirs
    try:
        with writing(Path(tmp)):
            tok.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclasses.dataclass
class PrepareReport:
    manifest: dict
    prepared_dir: Path
    skipped: List[str]
    """Steps whose output was already complete: tokenizer, train, validation, or all."""
    seconds: float
    notes: List[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        m = self.manifest
        tok = m["tokenizer"]
        lines = [f"prepared {self.prepared_dir}  (source {m['source']}, {m['documents']} documents, "
                 f"{self.seconds:.1f}s; skipped: {', '.join(self.skipped) or 'nothing'})",
                 f"  tokenizer   {tok['path']}  vocab {tok['vocab_size']}  eos id {tok['eos_id']}  "
                 f"sha256 {tok['sha256'][:12]}"]
        for split in SPLITS:
            s = m["splits"][split]
            lines.append(f"  {split:<11} {s['documents']:>8,} docs  {s['tokens']:>13,} tokens  "
                         f"max id {s['max_token_id']}  {len(s['files'])} shard(s)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _settings(config: Config, max_documents: Optional[int]) -> dict:
    d = config.data
    inputs = source_fingerprint(d)  # first: it checks every path (a symlink loop cannot be resolved)
    return {"source": d.source, "paths": [str(Path(p).expanduser().resolve()) for p in d.paths],
            "text_key": d.text_key, "seed": config.general.seed, "validation_fraction": d.validation_fraction,
            "max_documents": max_documents, "inputs": inputs}


def _diff(old: dict, new: dict) -> List[str]:
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" if k != "inputs" else "inputs: files or sizes changed"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _split_docs(config: Config, split: str, val: Set[int], max_documents: Optional[int]) -> Iterator[Document]:
    for i, doc in enumerate(iter_documents(config.data, max_documents)):
        if (i in val) == (split == "validation"):
            yield doc


def _tokenize_split(config: Config, split: str, val: Set[int], n_docs: int, out: Path, tok_path: Path,
                    sha: str, settings: dict, max_documents: Optional[int], progress: bool) -> None:
    # datatrove / tokenizers only when preparing or reading data (seconds to import)
    from datatrove.pipeline.tokens import DocumentTokenizer

    tmp = out / f".partial-{split}"
    shutil.rmtree(tmp, ignore_errors=True)
    # No document shuffling here: shards keep reading order (checkable against the source);
    # the loader draws a seeded permutation of sequences every epoch instead.
    step = DocumentTokenizer(str(tmp), str(tok_path), eos_token=EOS_TOKEN, save_filename=split,
                             shuffle_documents=False, batch_size=64)
    docs = tqdm(_split_docs(config, split, val, max_documents), total=n_docs, unit="doc",
                desc=f"tokenizing {split}", disable=not progress)
    with writing(tmp):  # datatrove's shard writes: a full disk named no file
        step.run(docs, rank=0, world_size=1)
    files = sorted(p.name for p in tmp.glob("*.ds"))
    dtype = np.uint16 if step.token_size == 2 else np.uint32
    shard_tokens: Dict[str, int] = {}
    documents, max_id = 0, -1
    for name in files:
        arr = np.memmap(tmp / name, dtype=dtype, mode="r") if (tmp / name).stat().st_size else np.zeros(0, dtype)
        shard_tokens[name] = int(arr.size)
        max_id = max(max_id, int(arr.max()) if arr.size else -1)
        documents += (tmp / f"{name}.index").stat().st_size // 8  # uint64 document ends
    info = {"documents": documents, "tokens": sum(shard_tokens.values()), "max_token_id": max_id,
            "files": files, "shard_tokens": shard_tokens, "shard_sha256": {n: sha256_file(tmp / n) for n in files},
            "token_size": step.token_size, "tokenizer_sha256": sha, "settings": settings}
    _write_json_atomic(tmp / SPLIT_INFO, info)
    if (out / split).exists():
        shutil.rmtree(out / split)  # a stale split of an earlier prepare (_check_ours ran up front)
    os.replace(tmp, out / split)


def split_problem(split_dir: Path, info: dict, token_size: int, verify: bool = False) -> Optional[str]:
    """Why the shards in `split_dir` do not match `info` (its split.json or manifest entry), or None.
    The shard list, document and token counts and sizes are always checked; sha256 too with `verify` (it
    reads every byte)."""
    on_disk = sorted(p.name for p in split_dir.glob("*.ds"))
    if not info["files"] or not info["documents"] or not info["tokens"]:
        return f"{split_dir} is recorded with {info['documents']} documents, {info['tokens']} tokens and no shards"
    if sorted(info["files"]) != on_disk or sorted(info["shard_tokens"]) != sorted(info["files"]):
        return f"{split_dir} holds shards {on_disk}, its record lists {sorted(info['files'])}"
    if sum(info["shard_tokens"].values()) != info["tokens"]:
        return f"{split_dir}: its shards' token counts do not add up to the recorded {info['tokens']} tokens"
    for name, tokens in info["shard_tokens"].items():
        f = split_dir / name
        if not f.exists() or not f.with_name(f"{name}.index").exists():
            return f"{f} (or its .index) is missing"
        if f.stat().st_size != tokens * token_size:
            return f"{f} has {f.stat().st_size} bytes, {tokens * token_size} expected"
        expected = info.get("shard_sha256", {}).get(name)  # None in folders prepared before checksums
        if verify and expected is not None and sha256_file(f) != expected:
            return f"{f} does not match its sha256"
    return None


def _manifest_problem(split_dir: Path, entry: dict) -> Optional[str]:
    """Why the manifest's entry for a split disagrees with the split's own split.json, or None."""
    try:
        info = json.loads((split_dir / SPLIT_INFO).read_text())
    except (OSError, ValueError) as e:
        return f"{split_dir / SPLIT_INFO} cannot be read ({e})"
    differ = sorted(k for k in entry if info.get(k) != entry[k])
    return f"{MANIFEST} and {split_dir / SPLIT_INFO} differ in {', '.join(differ)}" if differ else None


def prepare(config: Config, *, max_documents: Optional[int] = None, progress: bool = True,
            verify: bool = False) -> PrepareReport:
    """Build `data.prepared_dir` (and `tokenizer.path` when missing) for `config`; idempotent.

    Outputs are skipped only when they exist and match their records (sizes; with `verify` also sha256);
    a split that does not is rebuilt, and the report says why."""
    t0 = time.perf_counter()
    out = Path(config.data.prepared_dir)
    if out.exists() and not out.is_dir():  # was "[Errno 17] File exists ...; free space" from the lock below
        raise DataError(f"data.prepared_dir {out} is a file, not a folder; set data.prepared_dir to a folder")
    if out.is_symlink() and not out.exists():
        raise DataError(f"data.prepared_dir {out} is a symbolic link to nothing (a loop, or its target is missing); "
                        "set data.prepared_dir to a folder")
    if Path(config.tokenizer.path).is_dir():
        load_tokenizer(Path(config.tokenizer.path))  # its one line, before the corpus is read
    settings = _settings(config, max_documents)  # lists the inputs: missing ones and packages fail first
    _check_no_overlap(config)
    for split in SPLITS:  # before the lock file: never write into a folder that is not ours
        if (out / split).exists():
            _check_ours(out / split)
    # Two prepares on one folder used to interleave their temp folders and leave a manifest of 0 documents.
    with lock_folder(out, "data.prepared_dir", "another data.prepared_dir"):
        return _prepare_locked(config, out, settings, max_documents, progress, verify, t0)


def _prepare_locked(config: Config, out: Path, settings: dict, max_documents: Optional[int], progress: bool,
                    verify: bool, t0: float) -> PrepareReport:
    tok_path = Path(config.tokenizer.path)
    manifest_path = out / MANIFEST
    notes: List[str] = []
    manifest = None
    if manifest_path.exists():
        try:
            manifest = read_manifest_file(out, "")
        except DataError as e:  # written last, atomically: damaged afterwards; rebuilt below like a damaged split
            notes.append(f"{MANIFEST} was not trusted: {e}; it is written again")
    if manifest is not None:
        problems = _diff(manifest["settings"], settings)
        if not tok_path.exists():
            problems.append(f"tokenizer {tok_path} is missing (shards were made with sha256 "
                            f"{manifest['tokenizer']['sha256'][:12]})")
        elif sha256_file(tok_path) != manifest["tokenizer"]["sha256"]:
            problems.append(f"tokenizer {tok_path} differs from the one the shards were made with")
        if problems:
            raise DataError(f"{out} was prepared with other settings ({'; '.join(problems)}); "
                            "delete it or set data.prepared_dir to another folder")
        damaged = [_manifest_problem(out / split, manifest["splits"][split])
                   or split_problem(out / split, manifest["splits"][split], manifest["token_size"], verify)
                   for split in SPLITS]
        if not any(damaged):
            return PrepareReport(manifest, out, ["all"], time.perf_counter() - t0,
                                 _vocab_notes(manifest["vocab_size"], config.tokenizer.vocab_size, tok_path, out))
        notes += [f"{MANIFEST} was not trusted: {p}" for p in damaged if p]

    out.mkdir(parents=True, exist_ok=True)
    stats: Dict[str, Dict[str, int]] = {}
    n_docs = sum(1 for _ in tqdm(iter_documents(config.data, max_documents, stats), unit="doc",
                                 desc=f"reading {config.data.source}", disable=not progress))
    val = validation_indices(n_docs, config.general.seed, config.data.validation_fraction)
    counts = {"train": n_docs - len(val), "validation": len(val)}
    skipped: List[str] = []

    if tok_path.exists():
        skipped.append("tokenizer")
    else:
        texts = (d.text for d in _split_docs(config, "train", val, max_documents))
        train_tokenizer(texts, config.tokenizer.vocab_size, tok_path, length=counts["train"], show_progress=progress)
    tok_info = _check_tokenizer(tok_path)
    _vocab_notes(tok_info["vocab_size"], config.tokenizer.vocab_size, tok_path, out)  # fail before tokenizing

    for split in SPLITS:
        info_path = out / split / SPLIT_INFO
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if info["settings"] == settings and info["tokenizer_sha256"] == tok_info["sha256"]:
                problem = split_problem(out / split, info, info["token_size"], verify)
                if problem is None:
                    skipped.append(split)
                    continue
                notes.append(f"rebuilt {split}: {problem}")
        _tokenize_split(config, split, val, counts[split], out, tok_path, tok_info["sha256"], settings,
                        max_documents, progress)

    infos = {split: json.loads((out / split / SPLIT_INFO).read_text()) for split in SPLITS}
    splits = {split: {k: info[k] for k in ("documents", "tokens", "max_token_id", "files", "shard_tokens",
                                           "shard_sha256")}
              for split, info in infos.items()}
    manifest = {"format": FORMAT_VERSION, "source": config.data.source, "documents": n_docs,
                "vocab_size": tok_info["vocab_size"], "token_size": infos["train"]["token_size"],
                "tokenizer": tok_info, "splits": splits, "settings": settings}
    _write_json_atomic(manifest_path, manifest)  # last: its presence marks the folder complete
    return PrepareReport(manifest, out, skipped, time.perf_counter() - t0,
                         _vocab_notes(tok_info["vocab_size"], config.tokenizer.vocab_size, tok_path, out)
                         + _skip_notes(stats, config.data.text_key) + notes)


def _skip_notes(stats: Dict[str, Dict[str, int]], text_key: str) -> List[str]:
    """Documents read vs rows skipped (no text under data.text_key), per file that skipped any."""
    return [f"{f}: {s['read']} documents read, {s['skipped']} rows skipped (no text under data.text_key="
            f"{text_key!r})" for f, s in stats.items() if s["skipped"]]


def _check_no_overlap(config: Config) -> None:
    """prepare writes into data.prepared_dir, so no input may lie inside it and it may not lie inside an input."""
    out = Path(config.data.prepared_dir).expanduser().resolve()
    for i, raw in enumerate(config.data.paths if config.data.source != "sotu" else []):
        p = Path(raw).expanduser().resolve()
        if p == out or out in p.parents or p in out.parents:
            raise DataError(f"data.paths[{i}] {p} and data.prepared_dir {out} overlap; prepare writes token "
                            "shards into data.prepared_dir and must not touch your inputs: set "
                            "data.prepared_dir to a folder outside every input path")


def _check_ours(split_dir: Path) -> None:
    """Only a folder holding our split.json marker was written by prepare and may be replaced."""
    if not (split_dir / SPLIT_INFO).exists():
        raise DataError(f"{split_dir} exists but was not written by prepare (no {SPLIT_INFO}); prepare never "
                        "deletes what it did not create: move it away or set data.prepared_dir to another folder")


def _vocab_notes(actual: int, configured: int, tok_path: Path, out: Path) -> List[str]:
    if actual > configured:
        raise DataError(f"tokenizer {tok_path} has {actual} tokens but tokenizer.vocab_size={configured}; "
                        f"delete it and {out} to retrain, or raise tokenizer.vocab_size")
    if actual < configured:
        return [f"tokenizer {tok_path} has {actual} tokens, fewer than tokenizer.vocab_size={configured} (it "
                f"existed already, or the corpus allows no more merges); delete it and {out} to retrain"]
    return []


def load_tokenizer(path: Path, flag: Optional[str] = None):
    """The tokenizer at `path`; a damaged file is a DataError naming it (the library's message names no file).
    `flag`: the command's flag that gave the path (--tokenizer): the user's own file, which the message never
    advises deleting (prepare's tokenizer.path it does: prepare trains a new one there)."""
    # datatrove / tokenizers only when preparing or reading data (seconds to import)
    from tokenizers import Tokenizer

    if path.exists() and not path.is_file():  # a folder: "delete it" below would be the wrong advice
        raise DataError(f"tokenizer {path} is not a file (a folder?); tokenizer.path (or --tokenizer) names the "
                        f"tokenizer JSON, e.g. {path / 'tokenizer.json'}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        if flag is not None:
            raise DataError(f"tokenizer {path} ({flag}) cannot be read ({e}); it must be the tokenizer JSON the run "
                            "was trained with (pass it with --tokenizer)") from None
        raise DataError(f"tokenizer {path} cannot be read ({e}); delete it and re-run prepare into a fresh "
                        "data.prepared_dir (shards depend on the tokenizer)") from None


def _check_tokenizer(path: Path) -> dict:
    tok = load_tokenizer(path)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise DataError(f"tokenizer {path} has no {EOS_TOKEN} token (the document separator); "
                        "delete it so that prepare trains a new one")
    return {"path": str(path.resolve()), "sha256": sha256_file(path), "vocab_size": tok.get_vocab_size(),
            "eos_id": eos_id}
