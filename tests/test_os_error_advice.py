"""Issue 41: an OS error's message names the file and gives the advice its cause calls for. prepare onto a full
disk said "[Errno 28] No space left on device; free space or make the folder writable" without naming any file,
and a name too long for the file system (or a damaged parquet file's OSError) was told to free space."""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, List

from tests.helpers.runs import TINY


def _prepare(sets: List[str]) -> int:
    from nanotron_ext.data.__main__ import main

    return main(["prepare", "--config-file", str(TINY), "--no-progress", *[a for s in sets for a in ("--set", s)]])


def test_prepare_onto_a_full_disk_names_the_folder_it_was_writing(tmp_path: Path, capsys, monkeypatch) -> None:
    # "error: [Errno 28] No space left on device; free space or make the folder writable": which folder?
    from datatrove.pipeline.tokens import DocumentTokenizer

    from tests.helpers.runs import write_corpus

    def full(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # what a write() says: no file name

    monkeypatch.setattr(DocumentTokenizer, "run", full)
    write_corpus(tmp_path / "corpus.jsonl", n_docs=6, chars=300)
    prepared = tmp_path / "prepared"
    assert _prepare(["data.source=jsonl", f"data.paths=[{tmp_path / 'corpus.jsonl'}]", f"data.prepared_dir={prepared}",
                     f"tokenizer.path={prepared / 'tokenizer.json'}", "tokenizer.vocab_size=300"]) == 2
    assert capsys.readouterr().err == (
        f"error: [Errno 28] No space left on device: '{prepared / '.partial-train'}'; free space there or make the "
        "folder writable (or set data.prepared_dir / tokenizer.path)\n")


def test_a_name_too_long_for_the_file_system_gets_no_free_space_advice(tmp_path: Path, capsys) -> None:
    # prepare: "[Errno 36] File name too long: ...; free space or make the folder writable"
    from nanotron_ext.errors import os_error_line

    long = tmp_path / ("r" * 300)
    assert _prepare([f"data.prepared_dir={long}"]) == 2
    assert capsys.readouterr().err == (f"error: [Errno 36] File name too long: '{long}'; a name in that path is longer "
                                       "than the file system allows (255 bytes on most): shorten it "
                                       "(data.prepared_dir)\n")
    from nanotron_ext.launch import main

    sets = ["parallelism.dp=1", f"general.output_dir={tmp_path}", f"general.run={long.name}"]
    assert main(["--nproc_per_node=1", "-m", "nanotron_ext.train", "--config-file", str(TINY),
                 *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err  # refused at config load now, before any folder is made (issue 53)
    assert err.startswith("error: general.run: a name of 300 bytes is longer than a folder name may be")
    assert err.count("\n") == 1 and "general.run" in err
    # an OSError of no errno (pyarrow's on a damaged file) gets no disk advice; a full disk does
    assert os_error_line(OSError("Couldn't deserialize thrift")) == "Couldn't deserialize thrift"
    assert os_error_line(OSError(errno.ENOSPC, "No space left on device", "/x")).endswith(
        "; free space there or make it writable (or set general.output_dir / checkpoints.dir)")
