"""Issue 33 row 16, the WAN meter (`python -m nanotron_ext.bench.wan`): its arguments are checked before anything is
trained or written, each bad one is one line naming it with exit code 2. They used to pass and then fail: `--dry-run`
outside the checkout ("config file not found" traceback), `--steps 0` / `-1` and a `--set` typo (a ConfigError
traceback, or the first run's "last error"), `--from-json` of a JSON list (exit 1) or of another script's result
(KeyError while rendering)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from tests.helpers.runs import REPO

DRY = ["--dry-run", "--systems", "pipeline", "--seeds", "1"]


def _wan(args: List[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the checkout under test, from any folder
    return subprocess.run([sys.executable, "-m", "nanotron_ext.bench.wan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_line(got: subprocess.CompletedProcess) -> str:
    assert got.returncode == 2, (got.returncode, got.stdout[-1000:], got.stderr[-3000:])
    return got.stderr.splitlines()[0]


def test_dry_run_from_another_folder_finds_the_checkouts_config(tmp_path: Path) -> None:
    got = _wan(DRY, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    assert f"- internet-200m-50ms pipeline seed 1: {REPO / 'reproduce/wan/cpu_base.yaml'} " in got.stdout
    assert _one_line(_wan(DRY + ["--config", "no/such.yaml"], cwd=tmp_path)) == (
        f"error: --config no/such.yaml does not exist (looked in {tmp_path} and in the checkout {REPO})")


@pytest.mark.parametrize("flag, value, line", [
    ("--steps", "0", "--steps 0: must be >= 1"),
    ("--steps", "-1", "--steps -1: must be >= 1"),
    ("--val-every", "0", "--val-every 0: must be >= 1"),
    ("--inner-steps", "-1", "--inner-steps -1: must be >= 1"),
    ("--timeout-s", "0", "--timeout-s 0.0: must be a finite number in (0, inf]"),
    ("--target-rel", "nan", "--target-rel nan: must be a finite number in (-1, inf]"),
    ("--seeds", "-1", "--seeds -1: must be >= 0"),
    ("--reference", "ddp", "--reference ddp is not among --systems pipeline: its final validation loss sets the "
                           "target every system is timed to"),
])
def test_bad_numbers_and_reference_are_one_line(flag: str, value: str, line: str) -> None:
    assert _one_line(_wan(DRY + [flag, value])) == f"error: {line}"


def test_a_set_typo_is_refused_before_any_run(tmp_path: Path) -> None:
    runs, out = tmp_path / "runs", tmp_path / "result.json"
    got = _wan(["--systems", "pipeline", "--seeds", "1", "--steps", "2", "--runs", str(runs), "--out", str(out),
                "--set", "optimizer.lrr=1e-3"])
    assert _one_line(got).startswith("error: --set (run internet-200m-50ms pipeline seed 1): optimizer.lrr: unknown "
                                     "key; did you mean 'lr'?; allowed keys in section optimizer: name, lr, ")
    assert not runs.exists() and not out.exists()


def test_runs_that_is_a_file_and_out_that_is_a_folder_are_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "result.json").mkdir()
    assert _one_line(_wan(DRY + ["--runs", str(tmp_path / "file")])) == (
        f"error: --runs {tmp_path / 'file'} is a file; give the path of a folder to write")
    assert _one_line(_wan(DRY + ["--out", str(tmp_path / "result")])) == (
        f"error: --out {tmp_path / 'result.json'} is a folder; give the path of a file to write")


def test_out_that_is_another_file_is_never_replaced(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"  # a run's record, named by mistake
    summary.write_text(json.dumps({"steps": 2, "final_val_loss": 5.1}))
    saved = REPO / "reproduce" / "wan" / "results" / "cpu_internet-200m-50ms.json"
    got = _wan(["--from-json", str(saved), "--out", str(summary)])
    assert _one_line(got) == (f"error: --out {summary} exists and is not an earlier result of a reproduction script (a "
                              "JSON object with rows, meta); nothing was written: choose another file")
    assert json.loads(summary.read_text()) == {"steps": 2, "final_val_loss": 5.1}
    assert not summary.with_suffix(".md").exists()


def test_from_json_of_the_wrong_shape_is_one_line(tmp_path: Path) -> None:
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([1, 2]))
    other = REPO / "reproduce" / "boost" / "results" / "cpu_table3.json"  # BOOST Table 3's: rows of another shape
    out = tmp_path / "out.json"
    assert _one_line(_wan(["--from-json", str(listed), "--out", str(out)])) == (
        f"error: --from-json {listed} holds a JSON list, not an object")
    assert _one_line(_wan(["--from-json", str(other), "--out", str(out)])) == (
        f"error: --from-json {other}: row 0 has no 'preset'; not a result of python -m nanotron_ext.bench.wan")
    assert _one_line(_wan(["--from-json", "/dev/zero", "--out", str(out)])) == (
        "error: --from-json /dev/zero is a character device, not a file; a file is expected")
    assert not out.exists()


# -- issue 41: saved results given to --calibration-from and --merge ------------------------------------------------
SAVED = REPO / "reproduce" / "wan" / "results" / "cpu_internet_1g.json"  # calibrated internet-1g-cpu (pp, dp), 45 runs


def _saved(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    data = json.loads(SAVED.read_text())
    change(data)
    path = tmp_path / "result.json"
    path.write_text(json.dumps(data))
    return path


def _links(data: dict) -> dict:
    return data["meta"]["anchor_calibration"]["links_mbps_ms"]


@pytest.mark.parametrize("tier, link, problem", [
    # 0 Mbit/s is an unlimited link: the runs "on the preset" emulated no link at all, silently
    ("dp", [0, 4.37], "preset internet-1g-cpu tier dp: bandwidth 0 Mbit/s is not a finite number > 0 (0 means "
                      "unlimited: no link would be emulated)"),
    ("pp", [float("nan"), 5.6], "preset internet-1g-cpu tier pp: bandwidth nan Mbit/s is not a finite number > 0 (0 "
                                "means unlimited: no link would be emulated)"),
    ("pp", [9.3, -1], "preset internet-1g-cpu tier pp: latency -1 ms is not a finite number >= 0"),
    ("pp", [9.3, float("inf")], "preset internet-1g-cpu tier pp: latency inf ms is not a finite number >= 0"),
    ("pp", 9.3, "preset internet-1g-cpu tier pp: a JSON number where a link [Mbit/s, ms] is expected"),
])
def test_calibration_from_links_no_run_can_use_are_refused(tmp_path: Path, tier: str, link, problem: str) -> None:
    from nanotron_ext.bench.wan.args import saved_calibration
    from nanotron_ext.cli_checks import ArgumentError

    path = _saved(tmp_path, lambda d: _links(d)["internet-1g-cpu"].__setitem__(tier, link))
    with pytest.raises(ArgumentError) as e:
        saved_calibration(str(path), ["internet-1g-cpu"])
    assert str(e.value) == (f"--calibration-from {path}: {problem}; calibrate again (the same command without "
                            "--calibration-from)")
    assert saved_calibration(str(SAVED), ["internet-1g-cpu"])["links_mbps_ms"] == _links(json.loads(SAVED.read_text()))


def test_calibration_from_a_result_of_the_wrong_shape_is_one_line(tmp_path: Path) -> None:
    # an older result's links {preset: [Mbit/s, ms]} passed, then links_of failed ('list' object has no attribute
    # 'items'); a calibration without a tier the preset calibrates too (a KeyError in the runs' overrides)
    from nanotron_ext.bench.wan.args import saved_calibration
    from nanotron_ext.cli_checks import ArgumentError

    old = _saved(tmp_path, lambda d: _links(d).__setitem__("internet-1g-cpu", [9.3, 5.6]))
    with pytest.raises(ArgumentError, match=r"^--calibration-from .*: meta\.anchor_calibration\.links_mbps_ms\."
                                            r"internet-1g-cpu is a JSON list, not an object; calibrate again"):
        saved_calibration(str(old), ["internet-1g-cpu"])
    no_dp = _saved(tmp_path, lambda d: _links(d)["internet-1g-cpu"].pop("dp"))
    with pytest.raises(ArgumentError, match=r"^--calibration-from .*: preset internet-1g-cpu has no calibrated dp"):
        saved_calibration(str(no_dp), ["internet-1g-cpu"])
    got = _wan(DRY + ["--preset", "internet-1g-cpu", "--calibration-from", str(no_dp)])
    assert _one_line(got).startswith(f"error: --calibration-from {no_dp}: preset internet-1g-cpu has no calibrated dp")


def _set_run(key: str, value):  # type: ignore[no-untyped-def]
    return lambda d: d["runs"][2].__setitem__(key, value)


@pytest.mark.parametrize("change, problem", [
    (_set_run("final_val_loss", float("nan")), "runs[2] (dense_3d seed 3 on internet-1g-cpu).final_val_loss is nan, "
                                               "not a finite number"),
    (lambda d: d["runs"][2]["val_vs_wall"][0].__setitem__(1, float("nan")),
     "runs[2] (dense_3d seed 3 on internet-1g-cpu).val_vs_wall[0].validation loss is nan, not a finite number"),
    (_set_run("steady_step_s", 0), "runs[2] (dense_3d seed 3 on internet-1g-cpu).steady_step_s is 0; it must be > 0"),
    (lambda d: d["runs"].__setitem__(2, [1, 2]), "runs[2] is a JSON list, not an object"),
    (lambda d: d.__setitem__("runs", {"a": 1}), "runs is a JSON object, not a list"),
    (lambda d: d.__setitem__("meta", "x"), "meta is a JSON string, not an object"),
    (lambda d: d["runs"][2].pop("val_vs_wall"), "runs[2] (dense_3d seed 3 on internet-1g-cpu).val_vs_wall is missing"),
    (lambda d: _links(d)["internet-1g-cpu"].__setitem__("dp", [0, 1]),
     "preset internet-1g-cpu tier dp: bandwidth 0 Mbit/s is not a finite number > 0 (0 means unlimited: no link would "
     "be emulated)"),
])
def test_merge_of_results_of_the_wrong_shape_or_a_nan_loss_is_one_line(tmp_path: Path, change, problem: str) -> None:
    # AttributeError ('float' object has no attribute 'numerator': a NaN inside the statistics), TypeError,
    # KeyError tracebacks
    from nanotron_ext.bench.wan.results import merged_runs
    from nanotron_ext.cli_checks import ArgumentError

    path = _saved(tmp_path, change)
    with pytest.raises(ArgumentError) as e:
        merged_runs([str(path)])
    assert str(e.value) == f"--merge {path}: {problem}"
    assert len(merged_runs([str(SAVED)])[0]) == 45


def test_merge_of_a_nan_loss_exits_2_in_one_line(tmp_path: Path) -> None:
    path = _saved(tmp_path, _set_run("final_val_loss", float("nan")))
    out = tmp_path / "merged.json"
    assert _one_line(_wan(["--merge", str(path), "--out", str(out)])) == (
        f"error: --merge {path}: runs[2] (dense_3d seed 3 on internet-1g-cpu).final_val_loss is nan, not a finite "
        "number")
    assert not out.exists()
