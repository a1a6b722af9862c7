"""Issue 53, the caches and saved tables the tools read back (the read-file fuzz of tests/test_read_file_fuzz.py,
continued here for its size): the model clock's plan cache, the WAN meter's loss-run curves, reproduce's
PLAN.json, a stopped sweep's table, a cached MAPL analysis, a saved result's rows. Damaged (garbage, binary, empty,
a list, missing keys, NaN, and each reader's own wrong shapes), a cache entry is named in one line and recomputed;
a committed or user-named file is refused in one line naming the flag or file, exit 2, never a traceback or a
table of `nan`. And the `prepare` command printed for a damaged manifest carries the run's --set values."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.helpers import flag_fuzz as ff
from tests.test_read_file_fuzz import _cases, _folders, _launch, _refused

REPO = ff.REPO


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> ff.Sandbox:
    return ff.Sandbox(tmp_path_factory.mktemp("cache_fuzz_box"))


# -- caches the tools read back (issue 53): a damaged entry is recomputed with one line, a committed one refused -----
def _plan_damages() -> List[Tuple[str, bytes]]:
    """Every generic damage, and a plan of the planner's form with one part wrong."""
    good = {"layout": {"dp": 1, "tp": 1, "pp": 1}, "micro_batches": 2, "schedule": "afab", "outer_every": 0,
            "replica_of": {"0": 0}, "outer": None,
            "inner": [[{"rank": 0, "flops": 1e9, "ledger": {"tp": {"all_reduce": {"bytes": 8, "calls": 1}}}}]]}

    def bent(change) -> bytes:  # noqa: ANN001
        plan = json.loads(json.dumps(good))
        change(plan)
        return json.dumps(plan, allow_nan=True).encode()

    return [*_cases("json"),
            ("NaN FLOPs", bent(lambda p: p["inner"][0][0].update(flops=float("nan")))),
            ("infinite bytes", bent(lambda p: p["inner"][0][0]["ledger"]["tp"]["all_reduce"].update(bytes=1e999))),
            ("negative calls", bent(lambda p: p["inner"][0][0]["ledger"]["tp"]["all_reduce"].update(calls=-1))),
            ("another layout", bent(lambda p: p["layout"].update(pp=2))),
            ("a stage missing", bent(lambda p: p.update(inner=[[]]))),
            ("no ledger", bent(lambda p: p["inner"][0][0].pop("ledger"))),
            ("a bool for a count", bent(lambda p: p.update(micro_batches=True))),
            ("an outer step without outer_every", bent(lambda p: p.update(outer=p["inner"]))),
            ("a replica planned nowhere", bent(lambda p: p.update(replica_of={"0": 3})))]


@pytest.mark.parametrize("what, content", _plan_damages(), ids=[w for w, _ in _plan_damages()])
def test_a_damaged_plan_cache_entry_is_planned_again_with_one_line(tmp_path: Path, what: str, content: bytes,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from nanotron_ext.plan.cached import read_cached_plan

    path = tmp_path / "plan_0123456789abcdef.json"
    path.write_bytes(content)
    assert read_cached_plan(path, {"dp": 1, "tp": 1, "pp": 1}) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and err[0].endswith("planning it again"), err


def test_a_good_plan_cache_entry_is_read_back(tmp_path: Path) -> None:
    from nanotron_ext.plan.cached import read_cached_plan

    plan = {"layout": {"dp": 2, "tp": 1, "pp": 1}, "micro_batches": 2, "schedule": "1f1b", "outer_every": 0,
            "replica_of": {"0": 0, "1": 0}, "outer": None, "inner": [[{"flops": 5, "ledger": {}}]]}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    assert read_cached_plan(tmp_path / "p.json", {"dp": 2, "tp": 1, "pp": 1}) == plan
    assert read_cached_plan(tmp_path / "absent.json", {"dp": 2, "tp": 1, "pp": 1}) is None


@pytest.mark.slow
def test_step_time_plans_again_over_a_cached_plan_holding_nan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """End to end (plans the tiny config once, ~15 s): was a table of `nan` with exit 0."""
    from nanotron_ext.bench import step_time
    from nanotron_ext.bench.clock import plan_path
    from nanotron_ext.config.loader import load_config

    sets = ["parallelism.dp=1"]
    path = plan_path(load_config(ff.TINY, sets), tmp_path)
    path.write_text('{"layout": {"dp": 1, "tp": 1, "pp": 1}, "micro_batches": NaN}')
    argv = ["--config-file", str(ff.TINY), "--set", sets[0], "--preset", "resbm-a10g-80m", "--plans", str(tmp_path)]
    assert step_time.main(argv) == 0
    out, err = capsys.readouterr()
    assert "nan" not in out.lower() and len(err.strip().splitlines()) == 1 and str(path) in err
    assert json.loads(path.read_text())["micro_batches"] >= 1


def _loss_record(key: str) -> Dict:
    return {"system": "pipeline", "seed": 1, "key": key, "config_file": "c.yaml", "overrides": [], "replicas": 1,
            "mode": "dense", "steps": 4, "val_every": 2, "train_loss": [5.0, 4.0, 3.5, 3.0],
            "val_curve": [[2, 4.0], [4, 3.2]], "final_val_loss": 3.2, "sync_payload_bytes": [], "train_s": 1.0}


def _loss_damages() -> List[Tuple[str, bytes]]:
    def bent(change) -> bytes:  # noqa: ANN001
        record = _loss_record("k" * 12)
        change(record)
        return json.dumps(record, allow_nan=True).encode()

    return [*_cases("json"),
            ("a NaN validation loss", bent(lambda r: r["val_curve"][1].__setitem__(1, float("nan")))),
            ("a NaN final loss", bent(lambda r: r.update(final_val_loss=float("nan")))),
            ("an infinite training loss", bent(lambda r: r["train_loss"].append(float("inf")))),
            ("no curve", bent(lambda r: r.update(val_curve=[]))),
            ("a curve of numbers", bent(lambda r: r.update(val_curve=[2, 4.0]))),
            ("no final loss", bent(lambda r: r.pop("final_val_loss")))]


@pytest.mark.parametrize("what, content", _loss_damages(), ids=[w for w, _ in _loss_damages()])
def test_a_damaged_loss_run_cache_entry_is_trained_again_with_one_line(tmp_path: Path, what: str, content: bytes,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """bench.wan --clock model reads `<runs>/<system>_seed<seed>_<key>.json` back: a damaged one is not read (a
    traceback, or a table of `nan` with exit 0), it is said in one line and trained again; an intact file of
    another system with the same key is read instead."""
    from nanotron_ext.bench.wan import losses

    key = "k" * 12
    damaged = tmp_path / f"a_system_seed1_{key}.json"
    damaged.write_bytes(content)
    assert losses.finished(tmp_path, key, 1) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(damaged) in err[0] and err[0].endswith("training it again"), err
    (tmp_path / f"b_system_seed1_{key}.json").write_text(json.dumps(_loss_record(key)))
    assert losses.finished(tmp_path, key, 1) == _loss_record(key)


def test_a_loss_run_of_another_config_is_not_read_and_not_reported(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from nanotron_ext.bench.wan import losses

    (tmp_path / "pipeline_seed1_kkkkkkkkkkkk.json").write_text(json.dumps(_loss_record("another_key")))
    assert losses.finished(tmp_path, "kkkkkkkkkkkk", 1) is None and capsys.readouterr().err == ""


def _plan_table_damages() -> List[Tuple[str, bytes]]:
    run = {"layout": {"dp": 1, "tp": 1, "pp": 1, "pp_engine": "afab"}, "ranks": [{"flops": 1.0, "ledger": {}}]}

    def bent(change) -> bytes:  # noqa: ANN001
        table = {"written_by": "reproduce/plan_table.py", "runs": {"r": json.loads(json.dumps(run))}}
        change(table["runs"]["r"])
        return json.dumps(table, allow_nan=True).encode()

    return [*_cases("json"), ("a NaN FLOP count", bent(lambda r: r["ranks"][0].update(flops=float("nan")))),
            ("no layout", bent(lambda r: r.pop("layout"))), ("a rank without ledger", bent(
                lambda r: r["ranks"][0].pop("ledger")))]


@pytest.mark.parametrize("reader", ["paper_scale_plans", "plan_table"])
@pytest.mark.parametrize("what, content", _plan_table_damages(), ids=[w for w, _ in _plan_table_damages()])
def test_a_damaged_plan_table_is_refused_by_name(tmp_path: Path, what: str, content: bytes, reader: str, monkeypatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """reproduce/paper_scale.py (through paper_scale_plans) and reproduce/plan_table.py read the committed
    reproduce/results/PLAN.json back: damaged, it is refused in one line naming it, exit 2, nothing planned."""
    import sys

    sys.path.insert(0, str(REPO))
    from reproduce import paper_scale_plans as psp
    from reproduce import plan_table

    table = tmp_path / "PLAN.json"
    table.write_bytes(content)
    monkeypatch.setattr(psp, "PLAN_JSON", table)
    monkeypatch.setattr(plan_table, "OUT", tmp_path / "PLAN")
    monkeypatch.setattr(plan_table, "plan_run", lambda name: pytest.fail(f"{name} planned"))
    with pytest.raises(SystemExit) as stop:
        psp._saved_runs() if reader == "paper_scale_plans" else plan_table.main(["--from-json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and str(table) in err[0], err
    assert table.read_bytes() == content


def test_the_prepare_command_printed_for_a_damaged_manifest_carries_the_runs_sets(box: ff.Sandbox) -> None:
    """As printed it must rebuild the folder the run reads (it dropped `--set data.prepared_dir=...`)."""
    root = box / "manifest_advice"
    (root / "prepared").mkdir(parents=True, exist_ok=True)
    (root / "prepared" / "manifest.json").write_bytes(b'{"rows": [1, 2,,')
    outcome = _launch(box, _folders(root))
    _refused(outcome, "manifest.json")
    assert f"--set data.prepared_dir={root / 'prepared'}" in outcome.err, outcome.err
    assert f"--set tokenizer.path={root / 'prepared' / 'tok.json'}" in outcome.err, outcome.err
    assert "general.output_dir" not in outcome.err.split("prepare", 1)[-1]  # prepare does not read it


def _sweep_damages() -> List[Tuple[str, bytes]]:
    run = {"mode": "sparseloco", "overrides": ["general.seed=1"], "val_loss": 3.2, "train_loss": [4.0, 3.5]}

    def bent(change) -> bytes:  # noqa: ANN001
        saved = {"meta": {}, "summary": {}, "runs": {"het | seed 1": dict(run)}}
        change(saved["runs"]["het | seed 1"])
        return json.dumps(saved, allow_nan=True).encode()

    return [*_cases("json"), ("a NaN validation loss", bent(lambda r: r.update(val_loss=float("nan")))),
            ("no overrides", bent(lambda r: r.pop("overrides"))),
            ("a text loss", bent(lambda r: r.update(val_loss="3")))]


@pytest.mark.parametrize("what, content", _sweep_damages(), ids=[w for w, _ in _sweep_damages()])
def test_a_damaged_sweep_a_het_sparseloco_table_resumes_from_is_refused_by_name(tmp_path: Path, what: str,
                                                                                  content: bytes) -> None:
    """reproduce/het_sparseloco's tables resume a stopped sweep from their <out>.json: a damaged one was a traceback
    (or its NaN a table of nan); now one line naming --out and the file (the scripts' one_line_refusals)."""
    import sys

    from nanotron_ext.cli_checks import ArgumentError

    sys.path.insert(0, str(REPO))
    from reproduce.het_sparseloco.common import done_runs

    path = tmp_path / "table1.json"
    path.write_bytes(content)
    with pytest.raises(ArgumentError) as refused:
        done_runs(path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--out {path}") and "--fresh" in line, line


@pytest.mark.parametrize("what, content", [*_cases("json"), ("a NaN entry", b'{"rows": [{"cos": NaN}], "meta": {}}')],
                         ids=[w for w, _ in _cases("json")] + ["a NaN entry"])
def test_a_damaged_cached_mapl_analysis_is_analysed_again_with_one_line(tmp_path: Path, what: str, content: bytes,
                                                                        monkeypatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """reproduce/mapl's scripts read mapl_analysis.json back when it is newer than the run: damaged, it was a
    traceback; now it is named in one line and analysed again."""
    import os
    import sys

    sys.path.insert(0, str(REPO))
    from reproduce.mapl import common

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    out = run_dir / "mapl_analysis.json"
    out.write_bytes(content)
    os.utime(run_dir / "summary.json", (1, 1))  # the run older than its cached analysis: the cache is read
    good = {"rows": [{"boundary": 1, "cos": 0.5}], "meta": {"batches": 8}}

    def analysed(module: str, args: List[str], *rest, **kw) -> Tuple[int, str]:  # noqa: ANN002, ANN003
        out.write_text(json.dumps(good))
        return 0, ""

    monkeypatch.setattr(common, "launch", analysed)
    monkeypatch.setattr(common, "latest_checkpoint_of", lambda summary: run_dir / "ckpt")
    assert common.analyse({"run_dir": str(run_dir)}) == {"boundaries": good["rows"], "meta": good["meta"]}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and err[0].endswith("analysing again"), err
    assert common.analyse({"run_dir": str(run_dir)})["boundaries"] == good["rows"]  # read back, now intact
    assert capsys.readouterr().err == ""


def _sm_table_damages() -> List[Tuple[str, bytes]]:
    row = {"name": "centralised", "overrides": [], "summary": {"final_val_loss": 3.1}, "curve": []}
    nan = {"written_by": "nanotron_ext.bench.report", "meta": {}, "rows": [{**row, "summary": {"final_val_loss":
                                                                                             float("nan")}}]}
    nameless = {"written_by": "nanotron_ext.bench.report", "meta": {}, "rows": [{"summary": {}}]}
    return [*_cases("json"), ("a NaN loss", json.dumps(nan).encode()),
            ("a row without its name", json.dumps(nameless).encode())]


@pytest.mark.parametrize("what, content", _sm_table_damages(), ids=[w for w, _ in _sm_table_damages()])
def test_a_damaged_table_sm_cpu_compare_extends_is_refused_by_name(box: ff.Sandbox, what: str, content: bytes,
                                                                   monkeypatch) -> None:
    """reproduce/sm/cpu_compare.py reads its --out back to add rows to it: damaged, it was a traceback (or its NaN
    a table of nan); now one line naming --out and the file, before any row is trained."""
    import sys

    sys.path.insert(0, str(REPO))
    from reproduce.sm import cpu_compare

    monkeypatch.setattr(cpu_compare, "run_row", lambda *a, **k: pytest.fail("a row was trained"))
    path = box / f"sm_{what.replace(' ', '_')}.json"
    path.write_bytes(content)
    outcome = ff.run_case(cpu_compare.main, ["--out", str(path), "--rows", "centralised"], box)
    _refused(outcome, "--out", str(path))


@pytest.mark.parametrize("where", ["step", "loss"])
def test_a_saved_model_clock_result_with_a_nan_in_a_row_is_refused_by_name(box: ff.Sandbox, where: str) -> None:
    """`bench.wan --from-json` of a --clock model result: a NaN in a row printed a table of `nan` and wrote .json /
    .md with exit 0 (bench.report.read_saved now checks every row's numbers)."""
    from nanotron_ext.bench.wan.cli import main

    saved = json.loads((REPO / "reproduce" / "wan" / "results" / "model_clock.json").read_text())
    if where == "step":
        saved["rows"][0]["step_s"]["lower"] = float("nan")
    else:
        saved["rows"][-1]["final_val_loss"][0] = float("inf")
    path = box / f"model_clock_{where}.json"
    path.write_text(json.dumps(saved))
    outcome = ff.run_case(main, ["--from-json", str(path), "--out", str(box / f"rerendered_{where}")], box)
    _refused(outcome, "--from-json", str(path))
