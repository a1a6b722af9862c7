"""Every reproduction script follows one convention (nanotron_ext/bench/report.py): every option has a
help text that states its default, --out defaults to runs/ (a documented command never overwrites a
committed result), and `--from-json <its committed JSON>` re-renders in seconds, printing a header,
the rows and the paths it wrote: JSON + markdown + PNG. Convergence scripts also take
`--preset gpu --dry-run`, which resolves every run of the paper-scale experiment and prints its
config and parameter count without training."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
from pathlib import Path
from typing import Any, List

import pytest

REPO = Path(__file__).resolve().parents[1]
R = REPO / "reproduce"

# (script, its committed result)
SCRIPTS = [
    ("boost/table3_grouping.py", "boost/results/cpu_table3.json"),
    ("boost/table4_memory.py", "boost/results/cpu_table4.json"),
    ("boost/table5_checkpointing.py", "boost/results/cpu_table5.json"),
    ("boost/iter_compare.py", "boost/results/cpu_iter_compare_interleaved.json"),
    ("boost/fig6_scaling.py", "boost/results/cpu_fig6_scaling.json"),
    ("boost/fig7_compute.py", "boost/results/cpu_fig7_compute.json"),
    ("boost/fig8_comm.py", "boost/results/cpu_fig8_comm.json"),
    ("boost/table7_intensity.py", "boost/results/cpu_table7_intensity.json"),
    ("boost/fig4_loss_curve.py", "boost/results/cpu_fig4_loss_curve.json"),
    ("resbm/table2_convergence.py", "resbm/results/cpu_table2.json"),
    ("resbm/table3_throughput.py", "resbm/results/cpu_table3.json"),
    ("resbm/fig2_vs_sm.py", "resbm/results/cpu_fig2_vs_sm.json"),
    ("mapl/main_table.py", "mapl/results/cpu_main_table.json"),
    ("mapl/throughput.py", "mapl/results/cpu_throughput.json"),
    ("mapl/manifold_ablation.py", "mapl/results/cpu_manifold_ablation.json"),
    ("mapl/activation_findings.py", "mapl/results/cpu_activation_findings.json"),
    ("sm/cpu_compare.py", "sm/results/cpu_table1.json"),
    ("sm/table1_throughput.py", "sm/results/cpu_table1_throughput.json"),
    ("sm/fig3_depth.py", "sm/results/cpu_fig3_depth.json"),
    ("sm/table3_memory.py", "sm/results/cpu_table3_memory.json"),
    ("het_sparseloco/table1_main.py", "het_sparseloco/results/table1_cpu.json"),
    ("het_sparseloco/table2_ratio_sweep.py", "het_sparseloco/results/table2_cpu.json"),
    ("het_sparseloco/table3_no_inner_loop.py", "het_sparseloco/results/table3_cpu.json"),
    ("het_sparseloco/table4_ablations.py", "het_sparseloco/results/table4_cpu.json"),
    ("het_sparseloco/sim_sweep.py", "het_sparseloco/results/cpu_sweep_m4.json"),
    ("het_sparseloco/utilisation.py", "het_sparseloco/results/cpu_baseline.json"),
    ("het_sparseloco/stage_link.py", "het_sparseloco/results/cpu_stage_link.json"),
    ("het_sparseloco/outer_jump.py", "het_sparseloco/results/cpu_outer_jump.json"),
]
CONVERGENCE = ["resbm/table2_convergence.py", "mapl/main_table.py", "sm/cpu_compare.py",
               "het_sparseloco/table1_main.py", "het_sparseloco/table2_ratio_sweep.py",
               "het_sparseloco/table3_no_inner_loop.py", "het_sparseloco/table4_ablations.py", "sm/fig3_depth.py",
               "resbm/fig2_vs_sm.py", "mapl/manifold_ablation.py", "mapl/activation_findings.py"]


# scripts without a committed result yet, each with the reason reproduce/README.md gives on its row
NOT_RUN: dict = {}


def test_every_script_is_listed() -> None:
    """A new reproduction script joins SCRIPTS (with its committed result) or NOT_RUN (marked so in the index)."""
    helpers = {"common.py", "make_configs.py", "__init__.py", "param_counts.py"}
    found = {str(p.relative_to(R)) for p in R.glob("*/*.py") if p.name not in helpers}
    assert found == {s for s, _ in SCRIPTS} | set(NOT_RUN)
    index = (R / "README.md").read_text()
    for script in NOT_RUN:
        row = next(line for line in index.splitlines() if f"`{script.split('/')[1]}`" in line)
        assert row.endswith("| script ready, not run |"), row


RESULT_SUFFIXES = {".json", ".md", ".png"}  # what bench.report.publish writes; README.md is the folder's page


def test_results_live_in_results_apart_from_the_scripts() -> None:
    """reproduce/<paper>/ holds scripts, configs and its README; every committed result (a table's JSON, markdown,
    PNG, or a folder of them) lives in reproduce/<paper>/results/, and every listed result is there."""
    # (reproduce/results/ is not a paper's folder: the paper-scale scripts' results and the planner's cache)
    beside = [str(p.relative_to(R)) for paper in R.iterdir() if paper.is_dir()
              and paper.name not in ("__pycache__", "results") for p in paper.iterdir()
              if p.name not in ("results", "__pycache__", "README.md") and (p.is_dir() or p.suffix in RESULT_SUFFIXES)]
    assert not beside, "results beside the scripts (move them to <paper>/results/): " + ", ".join(sorted(beside))
    # and reproduce/'s own top level: scripts and README only, its results in reproduce/results/
    top = sorted(p.name for p in R.iterdir() if p.is_file() and p.suffix in RESULT_SUFFIXES and p.name != "README.md")
    assert not top, "results at reproduce/'s top level (move them to reproduce/results/): " + ", ".join(top)
    stems = [p.stem for p in R.iterdir() if p.name != "__pycache__" and p.name != "__init__.py"]
    assert len(stems) == len(set(stems)), "two entries of reproduce/ share a stem: " + ", ".join(sorted(stems))
    assert all(result.split("/")[1] == "results" for _, result in SCRIPTS)


def _load(script: str) -> Any:
    path = R / script
    spec = importlib.util.spec_from_file_location(f"repro_{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parsers(mod: Any, argv: List[str], monkeypatch: pytest.MonkeyPatch) -> List[argparse.ArgumentParser]:
    """Run main(argv) and return every parser it parsed with."""
    seen: List[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def spy(self, *a, **k):
        seen.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", spy)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 0
    return seen


@pytest.mark.parametrize("script,result", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_every_option_has_help_with_its_default_and_out_goes_to_runs(script: str, result: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parsers(_load(script), ["--help"], monkeypatch)[0]
    options = {a.dest: a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"}
    assert {"out", "from_json"} <= set(options), f"{script}: no --out / --from-json"
    for dest, a in options.items():
        assert a.help and "default" in a.help, f"{script}: --{dest} has no help text with its default"
    out = options["out"].default
    assert out and str(out).startswith("runs/"), f"{script}: --out defaults to {out!r}, not a path under runs/"


@pytest.mark.parametrize("script,result", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_a_bad_out_is_refused_when_parsed_before_anything_is_measured(script: str, result: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """--out naming a run's summary.json (not a result) or a folder: one line and exit 2 from the script's own
    parser, so no measurement is lost to an --out found bad only when the result is written (issue 33)."""
    parser = _parsers(_load(script), ["--help"], monkeypatch)[0]
    capsys.readouterr()
    summary = tmp_path / "summary.json"
    summary.write_text('{"final_val_loss": 4.2}')
    (tmp_path / "folder.json").mkdir()
    for out, why in ((summary, "is not an earlier result of a reproduction script"),
                     (tmp_path / "folder.json", "is a folder")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: --out {out} ") and why in err, err
    assert summary.read_text() == '{"final_val_loss": 4.2}'


@pytest.mark.parametrize("script,result", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_from_json_re_renders_the_committed_result(script: str, result: str, tmp_path: Path) -> None:
    mod = _load(script)
    out = tmp_path / "result.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = mod.main(["--from-json", str(R / result), "--out", str(out)])
    assert rc in (0, None)
    for suffix in (".json", ".md", ".png"):
        assert out.with_suffix(suffix).exists(), f"{script}: no {suffix} written"
    printed = buf.getvalue()
    assert f"wrote {out}" in printed
    header = printed.splitlines()[0]
    assert header and not header.startswith(("|", "-")), f"{script}: no header before the rows"
    data = json.loads(out.read_text())
    assert "meta" in data and "rows" in data and "paper" in data
    # the device comes from the run's meta, not from whoever re-renders it
    assert data["meta"].get("machine") or data["meta"].get("device")


@pytest.mark.parametrize("script", CONVERGENCE)
def test_gpu_preset_dry_run_prints_config_and_parameter_count(script: str, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    # in this process, as the re-render test (a subprocess per script spent ~5 s of the suite importing torch)
    monkeypatch.chdir(REPO)
    corpus = tmp_path / "corpus.jsonl"  # --data must exist (checked when parsed), the dry run reads nothing of it
    corpus.write_text('{"text": "x"}\n')
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = _load(script).main(["--preset", "gpu", "--data", str(corpus), "--seeds", "1", "2", "--dry-run"])
        except SystemExit as done:  # some scripts end their dry run with sys.exit, as from the command line
            rc = done.code
    assert rc in (0, None)
    out = buf.getvalue()
    assert "nothing trained" in out and "parameters " in out and "dtype=bf16" in out
    assert str(corpus) in out and "seed 1" in out and "seed 2" in out
