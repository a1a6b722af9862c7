"""Issue 33 rows 3, 4, 6 and 16: every command checks its arguments and the files it reads before doing any
work, and a bad one is one line naming the flag (or key) and the value or file, with exit code 2: it used to be a
wrong answer (eval --batch-size 0: loss 0, perplexity 1), a traceback, or a value that passed load."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest

from nanotron_ext.cli_checks import ArgumentError, Writer, output_file, output_stem
from tests.helpers.runs import REPO, TINY, train_tiny_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("cli_checks"))


def _cli(module: str, args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _one_line(got: subprocess.CompletedProcess) -> str:
    assert got.returncode == 2, (got.returncode, got.stdout[-2000:], got.stderr[-3000:])
    return got.stderr.splitlines()[0]


def _eval(trained: Path, *args: str) -> subprocess.CompletedProcess:
    run = ["--run", str(trained / "run"), "--checkpoints", str(trained / "ckpt")]
    return _cli("nanotron_ext.eval", run + ["--data", str(trained.parent / "corpus.jsonl"), *args])


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-1"])
def test_eval_batch_size_below_one_is_refused(trained: Path, value: str) -> None:
    # row 3: printed loss 0.0000, perplexity 1.00, bits per byte 0.0000 and exit 0
    assert _one_line(_eval(trained, "--batch-size", value)) == f"error: --batch-size {value}: must be >= 1"


@pytest.mark.slow
def test_eval_json_that_is_a_folder_is_refused_before_scoring(trained: Path, tmp_path: Path) -> None:
    # row 4: an IsADirectoryError traceback, after the whole scoring
    got = _eval(trained, "--json", str(tmp_path))
    assert _one_line(got) == f"error: --json {tmp_path} is a folder; give the path of a file to write"
    assert "loss" not in got.stdout


@pytest.mark.slow
def test_eval_parquet_source_on_a_jsonl_file_is_one_line(trained: Path) -> None:
    # row 4: pyarrow's ArrowInvalid traceback
    pytest.importorskip("pyarrow")
    data = trained.parent / "corpus.jsonl"
    assert _one_line(_eval(trained, "--source", "parquet")) == (
        f"error: --data: {data} is not a parquet file (no PAR1 header); --source parquet reads parquet files: check "
        "the file or the source")


@pytest.mark.slow
@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_generate_temperature_must_be_finite_and_not_negative(trained: Path, value: str) -> None:
    # row 16: nan passed the `< 0` check
    got = _cli("nanotron_ext.generate", ["--run", str(trained / "run"), "--checkpoints", str(trained / "ckpt"),
                                         "--prompt", "The", "--temperature", value])
    assert _one_line(got) == f"error: --temperature {float(value)}: must be a finite number in [0, inf]"


def test_init_from_config_json_that_is_a_list_is_one_line(tmp_path: Path) -> None:
    # row 6: an AttributeError traceback; checked when the job starts (issue 32: not at config load)
    (tmp_path / "config.json").write_text(json.dumps([{"model_type": "llama"}]))
    got = _cli("nanotron_ext.train", ["--config-file", str(TINY), "--set", f"model.init_from=hf:{tmp_path}"])
    assert _one_line(got) == (f"error: model.init_from: {tmp_path / 'config.json'} holds a JSON list, not an "
                              "object (a transformers config.json is one object of keys)")


@pytest.mark.parametrize("sets, line", [
    (["parallelism.pp=2", 'parallelism.link.per_stage_pair={"0-1": {"bandwidth_mbps": -5}}'],
     "parallelism.link.per_stage_pair.0-1.bandwidth_mbps: must be a finite number >= 0, got -5.0"),
    (["parallelism.pp=2", 'parallelism.link.per_stage_pair={"0-1": {"latency_ms": .nan}}'],
     "parallelism.link.per_stage_pair.0-1.latency_ms: must be a finite number >= 0, got nan"),
    (["sparseloco.fault_tolerance.replicas=2", "sparseloco.fault_tolerance.min_replicas=3"],
     "sparseloco.fault_tolerance.min_replicas: must be in [1, sparseloco.fault_tolerance.replicas=2], got 3"),
])
def test_config_values_that_passed_load_are_refused_there(sets: List[str], line: str) -> None:
    # row 16: a negative bandwidth and an unreachable quorum passed load, then failed with a traceback or
    # "last error: None"
    got = _cli("nanotron_ext.config", ["show", *[a for s in sets for a in ("--set", s)]])
    assert _one_line(got) == f"error: {line}"


def test_data_max_documents_below_one_is_refused(tmp_path: Path) -> None:
    got = _cli("nanotron_ext.data", ["prepare", "--config-file", str(REPO / "examples" / "config_tiny_llama.yaml"),
                                     "--set", f"data.prepared_dir={tmp_path / 'p'}", "--max-documents", "0"])
    assert _one_line(got) == "error: --max-documents 0: must be >= 1"
    assert not (tmp_path / "p").exists()


# -- issue 41: one rule for every file a command writes (cli_checks.Writer) -----------------------------------------
W = Writer("test writer", "the test writer", legacy_keys=("rows", "meta"))
OTHER = Writer("another writer")


def _png(path: Path, writer: Optional[Writer]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    if writer:
        writer.save_png(fig, path, dpi=20)
    else:
        fig.savefig(path, dpi=20)
    plt.close(fig)


def _read_only_filesystem(tmp: Path) -> Path:
    if os.access("/proc/sys", os.W_OK) or not os.path.isdir("/proc/sys"):
        pytest.skip("no read-only /proc/sys here")
    return Path("/proc/sys/out.json")


def _read_only(tmp: Path) -> Path:
    folder = tmp / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root writes anyway
        folder.chmod(0o755)
        pytest.skip("running as root: a read-only folder is writable")
    return folder / "out.json"


# (name, make the path in tmp, expected refusal or None when the file may be written)
FILE_CASES: List[Tuple[str, Callable[[Path], Path], Optional[str]]] = [
    ("device", lambda t: Path("/dev/null"), "is not a regular file (a device or a pipe?)"),
    ("fifo", lambda t: (os.mkfifo(t / "p.json"), t / "p.json")[1], "is not a regular file (a device or a pipe?)"),
    ("folder", lambda t: (t / "d.json").mkdir() or t / "d.json", "is a folder; give the path of a file to write"),
    ("file as parent", lambda t: (t / "f").write_text("x") and t / "f" / "out.json", "is a file, not a folder"),
    ("dangling symlink", lambda t: (t / "l.json").symlink_to(t / "nowhere") or t / "l.json", "symbolic link"),
    ("read-only parent", _read_only, "is not writable"),
    ("read-only file system", _read_only_filesystem, "the folder /proc/sys is not writable"),
    ("missing parents are created", lambda t: t / "a" / "b" / "out.json", None),
    ("new file", lambda t: t / "out.json", None),
    ("a foreign file", lambda t: (t / "notes.json").write_text('{"mine": 1}') and t / "notes.json",
     "exists and is not an earlier result of the test writer (a JSON object with rows, meta)"),
    ("a run's summary.json", lambda t: (t / "summary.json").write_text('{"final_val_loss": 4.2, "steps": 2}')
     and t / "summary.json", "is not an earlier result"),
    ("a run's metrics.jsonl", lambda t: (t / "metrics.jsonl").write_text('{"step": 1}\n') and t / "metrics.jsonl",
     "is not an earlier result"),
    ("not JSON", lambda t: (t / "x.json").write_bytes(b"\xff\x00") and t / "x.json", "is not an earlier result"),
    ("an earlier result with the marker", lambda t: W.write_json(t / "r.json", {"x": 1}), None),
    ("an earlier result without marker", lambda t: (t / "r.json").write_text('{"rows": [], "meta": {}}')
     and t / "r.json", None),
    ("another writer's result of the same shape", lambda t: OTHER.write_json(t / "r.json", {"rows": [], "meta": {}}),
     "is not an earlier result"),
    ("a markdown file with the marker", lambda t: W.write_markdown(t / "r.md", "# x\n"), None),
    ("a markdown file without", lambda t: (t / "r.md").write_text("# x\n") and t / "r.md", "is not an earlier result"),
    ("a PNG with the marker", lambda t: _png(t / "r.png", W) or t / "r.png", None),
    ("a PNG without", lambda t: _png(t / "r.png", None) or t / "r.png", "is not an earlier result"),
]


@pytest.mark.parametrize("name,make,refused", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_output_file_rule(tmp_path: Path, name: str, make: Callable[[Path], Path], refused: Optional[str]) -> None:
    path = make(tmp_path)
    before = path.read_bytes() if path.is_file() else None
    if refused is None:
        assert output_file("--json", path, W) == path
        if path.suffix == ".json":  # and it is written, atomically, marked
            W.write_json(path, {"x": 1})
            assert json.loads(path.read_text()) == {"written_by": "test writer", "x": 1} and W.wrote(path)
            assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
        return
    with pytest.raises(ArgumentError) as e:
        output_file("--json", path, W)
    assert str(e.value).startswith(f"--json {path}") and refused in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    if before is not None:
        assert path.read_bytes() == before


def _files(t: Path, stem: str, json_text: Optional[str], md: Optional[str], png: Optional[Writer | bool]) -> Path:
    if json_text is not None:
        (t / f"{stem}.json").write_text(json_text)
    if md is not None:
        (t / f"{stem}.md").write_text(md)
    if png is not None:
        _png(t / f"{stem}.png", png or None)
    return t / stem


LEGACY = '{"meta": {"date": "2026-01-01"}, "rows": [], "paper": []}'
MARKED_MD = "<!-- written by test writer -->\n# r\n"
# a stem-like --out (a reproduction script's, the WAN meter's): <out>.json, .md and .png
STEM_CASES: List[Tuple[str, Callable[[Path], Path], Optional[str]]] = [
    ("out is a device", lambda t: Path("/dev/null"), "--out /dev/null is not a regular file"),
    ("out is a fifo", lambda t: (os.mkfifo(t / "p"), t / "p")[1], "is not a regular file"),
    ("a committed result without markers", lambda t: _files(t, "r", LEGACY, "# r\n", False), None),
    ("an earlier marked result", lambda t: _files(t, "r", W.json_text({"rows": []}), MARKED_MD, W), None),
    ("a foreign markdown beside a new result", lambda t: _files(t, "r", None, "# my notes\n", None),
     "r.md exists and is not an earlier result"),
    ("a foreign PNG beside a new result", lambda t: _files(t, "r", None, None, False), "r.png exists and is not"),
    ("marked siblings of a deleted result", lambda t: _files(t, "r", None, MARKED_MD, W), None),
    ("a run's summary as the result", lambda t: _files(t, "summary", '{"final_val_loss": 4.2}', None, None),
     "summary.json exists and is not an earlier result"),
    ("a CSV beside its marked markdown",
     lambda t: (_files(t, "r", None, MARKED_MD, None), (t / "r.csv").write_text("a,b\n"), t / "r.csv")[2], None),
    ("a foreign CSV", lambda t: (t / "r.csv").write_text("a,b\n") and t / "r.csv", "r.csv exists and is not"),
]


@pytest.mark.parametrize("name,make,refused", STEM_CASES, ids=[c[0] for c in STEM_CASES])
def test_output_stem_rule(tmp_path: Path, name: str, make: Callable[[Path], Path], refused: Optional[str]) -> None:
    out = make(tmp_path)
    listing = sorted(os.listdir(out.parent))
    if refused is None:
        main = out if out.suffix == ".csv" else out.with_suffix(".json")
        assert output_stem("--out", out, W) == [main, main.with_suffix(".md"), main.with_suffix(".png")]
        return
    with pytest.raises(ArgumentError) as e:
        output_stem("--out", out, W)
    assert str(e.value).startswith("--out ") and refused in str(e.value), str(e.value)
    assert sorted(os.listdir(out.parent)) == listing  # nothing written (no /dev/null.json in /dev)


def test_wan_meter_out_that_is_a_device_or_a_pipe_writes_nothing(tmp_path: Path) -> None:
    """Issue 41: the meter's --out is a stem: --out /dev/null wrote /dev/null.json, .md and .png into /dev. Refused
    when parsed, one line, exit 2; a FIFO stays a FIFO and nothing is written beside it."""
    committed = REPO / "reproduce" / "wan" / "results" / "cpu_internet-200m-50ms.json"
    fifo = tmp_path / "result"
    os.mkfifo(fifo)
    got = _cli("nanotron_ext.bench.wan", ["--from-json", str(committed), "--out", str(fifo)])
    assert _one_line(got) == (f"error: --out {fifo} is not a regular file (a device or a pipe?); give the path of a "
                              "file to write") and got.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == ["result"] and fifo.is_fifo()
    dev = sorted(os.listdir("/dev"))
    got = _cli("nanotron_ext.bench.wan", ["--dry-run", "--out", "/dev/null"])  # (the old code exited 0 here)
    assert _one_line(got) == ("error: --out /dev/null is not a regular file (a device or a pipe?); give the path of a "
                              "file to write") and got.stdout == ""
    assert sorted(os.listdir("/dev")) == dev


def test_a_committed_result_is_regenerated_in_place(tmp_path: Path) -> None:
    """A result written before markers (JSON, .md and .png without one) is replaced by its documented command; after
    that every file carries the marker."""
    from nanotron_ext.bench.report import REPORT
    from nanotron_ext.cli_checks import MARKER_KEY

    committed = REPO / "benchmarks" / "results" / "codec_cost_cpu"
    for suffix in (".json", ".md", ".png"):
        if committed.with_suffix(suffix).exists():
            shutil.copy(committed.with_suffix(suffix), tmp_path / f"codec_cost_cpu{suffix}")
    out = tmp_path / "codec_cost_cpu.json"
    assert MARKER_KEY not in json.loads(out.read_text())
    got = subprocess.run([sys.executable, "benchmarks/codec_cost.py", "--from-json", str(out), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert all(REPORT.wrote(out.with_suffix(s)) for s in (".json", ".md", ".png"))


def _load_script(path: Path) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (command, its main, argv, the output flag, its value, the file it writes there: both under tmp)
SLOW_LINK = ["--config", str(TINY), "--setting", "a:model.codec.kind=identity", "--bandwidth", "1"]
FOLDER = str(TINY.parent)  # an input that exists: inputs are checked first, in the order given
MAPL = ["--config-file", str(TINY), "--checkpoint", FOLDER]
COMMANDS = [
    ("plan", "nanotron_ext.plan.__main__", ["--config-file", str(TINY)], "--json", "plan.json", "plan.json"),
    ("eval", "nanotron_ext.eval", ["--run", FOLDER, "--data", str(TINY)], "--json", "s.json", "s.json"),
    ("resbm.analyse", "nanotron_ext.resbm.analyse", ["--checkpoint", FOLDER], "--out", "o",
     "o/effective_rank.json"),
    ("resbm.analyse png", "nanotron_ext.resbm.analyse", ["--checkpoint", FOLDER], "--out", "o", "o/spectra.png"),
    ("subspace.analyse", "nanotron_ext.subspace.analyse", ["--config-file", str(TINY)], "--out", "o",
     "o/analysis.json"),
    ("mapl.analyse", "nanotron_ext.mapl.analyse", MAPL, "--out", "m.json", "m.json"),
    ("mapl.analyse md", "nanotron_ext.mapl.analyse", MAPL, "--out", "m.json", "m.md"),
    ("slow_link", "nanotron_ext.bench.slow_link", SLOW_LINK, "--out", "rows.json", "rows.json"),
    ("slow_link png", "nanotron_ext.bench.slow_link", SLOW_LINK, "--png", "t.png", "t.png"),
    ("resbm param_counts", "reproduce/resbm/param_counts.py", [], "--json", "c.json", "c.json"),
    ("boost param_counts", "reproduce/boost/param_counts.py", [], "--json", "c.json", "c.json"),
    ("a reproduction script", "reproduce/sm/table3_memory.py", [], "--out", "r", "r.png"),
    ("tiny_tokens_per_s", "benchmarks/tiny_tokens_per_s.py", [], "--out", "t.json", "t.json"),
    ("gpu_check", "benchmarks/gpu_check.py", ["--dry-run"], "--out", "g", "g/gpu_check.md"),
]


@pytest.mark.parametrize("name,where,argv,flag,value,written", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_command_refuses_to_replace_a_file_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  name: str, where: str, argv: List[str], flag: str,
                                                                  value: str, written: str) -> None:
    """Issue 41: each command's output is checked before any work; a file there that it did not write (here a run's
    summary, under the output's name) is left as it was: one line naming the flag, exit code 2."""
    import importlib

    mod = _load_script(REPO / where) if where.endswith(".py") else importlib.import_module(where)
    target = tmp_path / written
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text('{"final_val_loss": 4.2}')
    try:
        code = mod.main([*argv, flag, str(tmp_path / value)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {flag} {target} exists and is not an earlier result of "), err
    assert target.read_text() == '{"final_val_loss": 4.2}'
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted({*Path(written).parts})  # nothing else written


@pytest.mark.parametrize("script,argv", [
    ("reproduce/boost/fig6_scaling.py", ["--from-json", "{fifo}", "--out", "{tmp}/r"]),
    ("reproduce/boost/table3_grouping.py", ["--from-json", "{fifo}", "--out", "{tmp}/r"]),
    ("benchmarks/discrete_codec_sensitivity.py", ["--device", "cuda", "--merge", "{fifo}", "--out", "{tmp}/r"]),
], ids=["fig6 --from-json", "table3 --from-json", "discrete_codec_sensitivity --merge"])
def test_a_saved_result_that_is_a_pipe_is_one_line(tmp_path: Path, script: str, argv: List[str]) -> None:
    """--from-json of the BOOST scripts read a FIFO until a writer came (forever), /dev/zero until memory ran out;
    --merge of the codec sensitivity was read only after the CUDA arm had run."""
    fifo = tmp_path / "saved.json"
    os.mkfifo(fifo)
    flag = argv[argv.index("{fifo}") - 1]
    got = subprocess.run([sys.executable, script, *[a.format(fifo=fifo, tmp=tmp_path) for a in argv]], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert _one_line(got) == f"error: {flag} {fifo} is a named pipe, not a file; a file is expected"
    assert os.listdir(tmp_path) == ["saved.json"]
