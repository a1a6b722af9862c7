"""Issue 41 item 2, the files a command reads: garbage, binary, empty, a JSON list where an object is expected,
missing keys, a NaN. Each must be one line on stderr naming the file (or the flag that named it), exit code 2, no
traceback, nothing changed, before any work. Two kinds:

- a file given by a flag: every option whose flag type is an InputFile of a known format (a config's YAML, a saved
  result's JSON, a worker's JSON lines), found by introspecting the parsers as tests/test_flag_fuzz.py does;
- a file found inside what a flag or a config names: the data manifest (data.prepared_dir), a checkpoint's
  meta.json (checkpoints.dir, eval/generate/export --run), an exported model's config.json (model.init_from), the
  tokenizer (--tokenizer), the meter's results (--merge, --calibration-from)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from nanotron_ext import cli_flags as cf
from tests.helpers import flag_fuzz as ff
from tests.helpers.file_fuzz import CONTENTS
from tests.test_flag_fuzz import BY_NAME, FUZZED, TAIL, _options

REPO = ff.REPO
FILE_OPTIONS = sorted({(name, opt.name) for name in FUZZED for opt in _options(name)
                       if isinstance(opt.action.type, cf.InputFile) and opt.action.type.format in ("json", "yaml",
                                                                                                   "jsonl")})


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> ff.Sandbox:
    return ff.Sandbox(tmp_path_factory.mktemp("file_fuzz_box"))


def _refused(outcome: ff.Outcome, *names: str) -> None:
    problem = ff.refusal_problem(outcome, names)
    assert problem is None, problem


@pytest.mark.parametrize("name, option", FILE_OPTIONS, ids=[f"{n} {o}" for n, o in FILE_OPTIONS])
def test_a_damaged_file_given_by_a_flag_is_one_line(name: str, option: str, box: ff.Sandbox) -> None:
    opts = _options(name)
    opt = next(o for o in opts if o.name == option)
    main = BY_NAME[name].load().main
    problems = []
    for what, content, keys in CONTENTS[opt.action.type.format]:
        path = box / f"damaged_{what.replace(' ', '_')}.{opt.action.type.format}"
        path.write_bytes(content)
        outcome = ff.run_case(main, ff.argv_for(opt, opt.tokens(str(path)), opts, box, TAIL.get(name, [])), box)
        problem = ff.refusal_problem(outcome, (*opt.names, str(path), *keys))
        if problem:
            problems.append(f"{what}: {problem}")
    assert not problems, f"{name} {option}:\n" + "\n".join(problems)


# -- files inside what a config or a flag names --------------------------------------------------------------------
def _launch(box: ff.Sandbox, sets: List[str]) -> ff.Outcome:
    """The launcher's pre-flight in this process (the job's start-up checks, before any worker)."""
    from nanotron_ext.launch import main

    argv = ["--nproc_per_node=1", "-m", "nanotron_ext.train", "--config-file", str(ff.TINY)]
    return ff.run_case(main, argv + [a for s in sets for a in ("--set", s)], box)


def _folders(root: Path) -> List[str]:
    return ["parallelism.dp=1", f"general.output_dir={root / 'out'}", f"checkpoints.dir={root / 'ckpt'}",
            f"data.prepared_dir={root / 'prepared'}", f"tokenizer.path={root / 'prepared' / 'tok.json'}"]


def _cases(kind: str) -> List[Tuple[str, bytes]]:
    return [(what, content) for what, content, _ in CONTENTS[kind]]


@pytest.mark.parametrize("what, content", _cases("json"), ids=[w for w, _ in _cases("json")])
def test_a_damaged_data_manifest(box: ff.Sandbox, what: str, content: bytes) -> None:
    root = box / f"manifest_{what.replace(' ', '_')}"
    (root / "prepared").mkdir(parents=True, exist_ok=True)
    (root / "prepared" / "manifest.json").write_bytes(content)
    _refused(_launch(box, _folders(root)), "manifest.json")


@pytest.mark.parametrize("what, content", _cases("json"), ids=[w for w, _ in _cases("json")])
def test_a_damaged_checkpoint_meta_when_a_run_resumes(box: ff.Sandbox, what: str, content: bytes,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import nanotron_ext.data.loader as loader

    monkeypatch.setattr(loader, "read_manifest", lambda *a, **k: {})  # the data is not what this test is about
    root = box / f"resume_{what.replace(' ', '_')}"
    (root / "ckpt" / "step_3").mkdir(parents=True, exist_ok=True)
    (root / "ckpt" / "step_3" / "meta.json").write_bytes(content)
    _refused(_launch(box, _folders(root)), "meta.json", str(root / "ckpt"))


@pytest.mark.parametrize("what, content", _cases("json"), ids=[w for w, _ in _cases("json")])
def test_a_damaged_exported_config_for_init_from(box: ff.Sandbox, what: str, content: bytes) -> None:
    root = box / f"hf_{what.replace(' ', '_')}"
    root.mkdir(exist_ok=True)
    (root / "config.json").write_bytes(content)
    _refused(_launch(box, [*_folders(box / "init_from"), f"model.init_from=hf:{root}"]), "config.json", "init_from")


def _run_folder(box: ff.Sandbox, name: str, meta: bytes) -> Path:
    """A run folder (its config.yaml) and checkpoint step_1 with `meta` as its meta.json, no shards."""
    from nanotron_ext.config.loader import config_to_dict, load_config, save_config

    root = box / name
    run, step = root / "run", root / "ckpt" / "step_1"
    run.mkdir(parents=True, exist_ok=True)
    step.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ff.TINY, [f"checkpoints.dir={root / 'ckpt'}", f"tokenizer.path={root / 'tok.json'}"])
    save_config(cfg, run / "config.yaml")
    (step / "meta.json").write_bytes(meta.replace(b"CONFIG", json.dumps(config_to_dict(cfg)).encode()))
    return run


GOOD_META = b'{"step": 1, "files": [], "layout": {"dp": 1, "tp": 1, "pp": 1}, "config": CONFIG}'
READERS: Dict[str, List[str]] = {"nanotron_ext.eval": ["--data", "ok.jsonl"],
                                 "nanotron_ext.generate": ["--prompt", "The"],
                                 "nanotron_ext.export": ["--out", "exported"]}


@pytest.mark.parametrize("command", sorted(READERS))
def test_a_damaged_checkpoint_meta_read_by_eval_generate_export(box: ff.Sandbox, command: str) -> None:
    main = BY_NAME[command].load().main
    problems = []
    for what, content in _cases("json"):
        run = _run_folder(box, f"{command}_{what.replace(' ', '_')}", content)
        outcome = ff.run_case(main, ["--run", str(run), *READERS[command]], box)
        problem = ff.refusal_problem(outcome, ("meta.json", str(run.parent / "ckpt")))
        if problem:
            problems.append(f"{what}: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", sorted(READERS))
def test_a_damaged_tokenizer(box: ff.Sandbox, command: str) -> None:
    main = BY_NAME[command].load().main
    run = _run_folder(box, f"{command}_tokenizer", GOOD_META)
    problems = []
    for what, content in _cases("tokenizer"):
        tok = box / f"tok_{what.replace(' ', '_')}.json"
        tok.write_bytes(content)
        outcome = ff.run_case(main, ["--run", str(run), "--tokenizer", str(tok), *READERS[command]], box)
        problem = ff.refusal_problem(outcome, ("--tokenizer", str(tok)))
        if problem:
            problems.append(f"{what}: {problem}")
    assert not problems, "\n".join(problems)


SAVED = REPO / "reproduce" / "wan" / "results" / "cpu_internet_1g.json"  # a calibrated meter result with its runs


def _result_changes() -> List[Tuple[str, object]]:
    def nan_loss(d: dict) -> None:
        d["runs"][0]["final_val_loss"] = float("nan")

    def nan_link(d: dict) -> None:
        links = d["meta"]["anchor_calibration"]["links_mbps_ms"]
        links[next(iter(links))]["pp"] = [float("nan"), 5.0]

    def no_runs(d: dict) -> None:
        del d["runs"]

    def no_calibration(d: dict) -> None:
        del d["meta"]["anchor_calibration"]

    return [("a NaN loss", nan_loss), ("a NaN link", nan_link), ("no runs", no_runs),
            ("no calibration", no_calibration)]


@pytest.mark.parametrize("flag", ["--merge", "--calibration-from"])
def test_a_meter_result_of_the_wrong_shape_or_with_a_nan(box: ff.Sandbox, flag: str) -> None:
    from nanotron_ext.bench.wan.cli import main

    problems = []
    for what, change in _result_changes():
        if (flag, what) in {("--merge", "no calibration"), ("--calibration-from", "a NaN loss"),
                            ("--calibration-from", "no runs")}:
            continue  # what the flag does not read
        data = json.loads(SAVED.read_text())
        change(data)
        path = box / f"meter_{what.replace(' ', '_')}.json"
        path.write_text(json.dumps(data))
        extra = ["--preset", "internet-1g-cpu", "--dry-run"] if flag == "--calibration-from" else []
        outcome = ff.run_case(main, [flag, str(path), *extra, "--out", str(box / "merged")], box)
        problem = ff.refusal_problem(outcome, (flag, str(path)))
        if problem:
            problems.append(f"{what}: {problem}")
    assert not problems, "\n".join(problems)
