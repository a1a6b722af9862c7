"""The reproduction harness (nanotron_ext.bench) on its own: statistics against numpy/statistics,
the paper column's verdicts on synthetic rows, report files (JSON + markdown + PNG titled with
device and date), argument splitting, and timing/memory probes in one process."""
from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest

from nanotron_ext.bench import launch, paper, report, timing, workload


# ------------------------------------------------------------------------------------------------
# timing statistics
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_summary_agrees_with_numpy_and_statistics(warmup: int) -> None:
    times = list(np.random.default_rng(7).gamma(4.0, 0.01, size=17))
    kept = np.array(times[warmup:])
    s = timing.summarize(times, warmup)
    assert s.n == len(kept)
    assert s.mean == pytest.approx(float(np.mean(kept)))
    assert s.std == pytest.approx(float(np.std(kept, ddof=1)))  # sample std, as statistics.stdev
    assert s.std == pytest.approx(statistics.stdev(kept.tolist()))
    assert s.median == pytest.approx(float(np.median(kept)))
    assert (s.min, s.max) == (pytest.approx(float(kept.min())), pytest.approx(float(kept.max())))
    assert s.sem == pytest.approx(float(np.std(kept, ddof=1) / np.sqrt(len(kept))))


def test_summary_edge_cases() -> None:
    times = [9.0, 7.0, 1.0, 2.0, 3.0, 6.0]
    s = timing.summarize(times, warmup=2)
    assert (s.n, s.mean, s.median) == (4, pytest.approx(3.0), pytest.approx(2.5))
    assert s.std == pytest.approx(statistics.stdev([1.0, 2.0, 3.0, 6.0]))
    assert (s.min, s.max) == (1.0, 6.0)
    assert s.sem == pytest.approx(s.std / 2)
    assert timing.summarize([4.0], 0).std == 0.0
    with pytest.raises(ValueError):
        timing.summarize([1.0, 2.0], warmup=2)
    with pytest.raises(ValueError):
        timing.summarize([1.0], warmup=-1)


def test_pooled_summary_drops_warmup_of_every_round() -> None:
    s = timing.pooled_summary([[100.0, 1.0, 3.0], [50.0, 5.0, 7.0]], warmup=1)
    assert s.n == 4 and s.mean == pytest.approx(4.0)
    assert s.std == pytest.approx(float(np.std([1.0, 3.0, 5.0, 7.0], ddof=1)))


def test_speedup_and_its_standard_error() -> None:
    ref = timing.summarize([2.0, 2.2, 1.8, 2.0], 0)
    cand = timing.summarize([1.0, 1.1, 0.9, 1.0], 0)
    s, err = timing.speedup(ref, cand)
    assert s == pytest.approx(2.0)
    assert err == pytest.approx(2.0 * math.hypot(ref.sem / ref.mean, cand.sem / cand.mean))
    assert timing.speedup(cand, cand)[0] == pytest.approx(1.0)


def test_difference_and_ratio_errors_match_the_spread_of_repeated_experiments() -> None:
    """comp = mean total - mean comm of separate iterations, and its ratio between two variants: the
    propagated standard errors match the spread of the estimates over 4000 simulated experiments."""
    rng = np.random.default_rng(3)
    n, reps = 30, 4000
    diffs, ratios, errs, rerrs = [], [], [], []
    for _ in range(reps):
        tot_a, com_a = rng.gamma(20, 0.002, n), rng.gamma(5, 0.002, n)  # means 40 ms / 10 ms
        tot_b, com_b = rng.gamma(15, 0.002, n), rng.gamma(4, 0.002, n)  # means 30 ms / 8 ms
        d_a = timing.difference(timing.summarize(tot_a, 0), timing.summarize(com_a, 0))
        d_b = timing.difference(timing.summarize(tot_b, 0), timing.summarize(com_b, 0))
        r = timing.ratio(d_a, d_b)
        diffs.append(d_a[0]), errs.append(d_a[1]), ratios.append(r[0]), rerrs.append(r[1])
    assert np.mean(diffs) == pytest.approx(0.030, rel=0.01)
    assert np.mean(errs) == pytest.approx(np.std(diffs), rel=0.05)
    assert np.mean(ratios) == pytest.approx(30 / 22, rel=0.01)
    assert np.mean(rerrs) == pytest.approx(np.std(ratios), rel=0.1)  # first order: close, not exact
    assert timing.ratio((0.0, 0.1), (2.0, 0.0)) == (0.0, pytest.approx(0.05))  # a zero numerator is fine


def test_rotated_puts_every_variant_first_once() -> None:
    names = ["a", "b", "c"]
    firsts = [timing.rotated(names, r)[0] for r in range(3)]
    assert sorted(firsts) == names and timing.rotated(names, 1) == ["b", "c", "a"]
    assert timing.rotated([], 5) == []


class _Ledger:
    """Counts what the timed function 'sends', per group, like the comm ledger."""

    def __init__(self) -> None:
        self.sent: Dict[str, List[int]] = {}

    def reset(self) -> None:
        self.sent = {}

    def send(self, group: str, n: int) -> None:
        self.sent.setdefault(group, []).append(n)

    def bytes(self, group: str) -> int:
        return sum(self.sent.get(group, []))

    def calls(self, group: str) -> int:
        return len(self.sent.get(group, []))


def test_timed_and_interleaved_in_one_process() -> None:
    import torch

    ledger, order = _Ledger(), []

    def work(name: str, n: int):
        def go() -> None:
            order.append(name)
            ledger.send("tp", n)
            ledger.send("dp", 1)
        return go

    t = timing.timed(work("x", 8), torch.device("cpu"), 3, ledger=ledger)
    assert len(t.wall) == len(t.cpu) == 3 and all(w >= 0 for w in t.wall)
    assert t.comm == [{"bytes": 8, "calls": 1}] * 3 and t.comm_s == []
    assert timing.timed(work("x", 8), torch.device("cpu"), 1, ledger=ledger,
                        group="dp").comm == [{"bytes": 1, "calls": 1}]
    order.clear()
    got = timing.interleaved({"a": work("a", 4), "b": work("b", 16)}, torch.device("cpu"), 3, ledger=ledger)
    assert order == ["a", "b"] * 3  # iteration i of every variant before iteration i+1 of any
    assert [c["bytes"] for c in got["b"].comm] == [16, 16, 16] and len(got["a"].wall) == 3


def test_comm_split_times_totals_without_the_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """interleaved(comm_split=True): wall, CPU and ledger counts from unprofiled iterations, comm_s and
    profiled_wall from one profiled iteration per variant and round, run after the unprofiled pass, in
    rotated order. A fake profiler makes what it watches 20 ms slower."""
    import contextlib

    import torch

    state, order, ledger = {"on": False}, [], _Ledger()

    @contextlib.contextmanager
    def fake_profiler(device, memory=False):
        state["on"] = True
        try:
            yield "trace"
        finally:
            state["on"] = False

    clock = {"now": 0.0}  # a fake clock: a sleep overshoots on a loaded machine
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock["now"],
                                                        process_time=lambda: clock["now"]))
    monkeypatch.setattr(timing, "profiler_for", fake_profiler)
    monkeypatch.setattr(timing, "comm_seconds", lambda prof: 0.001 if prof == "trace" else float("nan"))

    def work(name: str) -> Any:
        def go() -> None:
            order.append((name, state["on"]))
            ledger.send("tp", 4 if not state["on"] else 1000)
            clock["now"] += 0.001 + (0.020 if state["on"] else 0.0)
        return go

    got = timing.interleaved({"a": work("a"), "b": work("b")}, torch.device("cpu"), 2, ledger=ledger, comm_split=True)
    assert order == [("a", False), ("b", False), ("a", True), ("b", True),
                     ("b", False), ("a", False), ("b", True), ("a", True)]
    for t in got.values():
        assert len(t.wall) == len(t.cpu) == len(t.comm_s) == len(t.profiled_wall) == 2
        assert t.wall == pytest.approx([0.001, 0.001]) and t.profiled_wall == pytest.approx([0.021, 0.021])
        assert t.comm_s == [0.001, 0.001] and [c["bytes"] for c in t.comm] == [4, 4]
    plain = timing.interleaved({"a": work("a")}, torch.device("cpu"), 2)
    assert plain["a"].comm_s == [] and plain["a"].profiled_wall == []


# ------------------------------------------------------------------------------------------------
# the paper column
# ------------------------------------------------------------------------------------------------
ROWS = [
    {"micro_batch": 1, "part": "block", "speedup": 1.19},
    {"micro_batch": 4, "part": "block", "speedup": 0.97},
    {"micro_batch": 4, "part": "mlp", "speedup": None},
    {"name": "btp", "act_vs_vanilla": 0.745},
]
CLAIMS = [
    paper.PaperClaim("grouping, bz=1", "speedup", 1.16, ">", 1.0, where={"micro_batch": 1, "part": "block"},
                     source="Table 3"),
    paper.PaperClaim("grouping, bz=4", "speedup", 1.04, ">", 1.0, where={"micro_batch": 4, "part": "block"},
                     source="Table 3"),
    paper.PaperClaim("grouping mlp, bz=4", "speedup", None, ">", 1.0, where={"micro_batch": 4, "part": "mlp"}),
    paper.PaperClaim("btp activations / vanilla", "act_vs_vanilla", 22.14 / 30.73, "<", 1.0, where={"name": "btp"}),
    paper.PaperClaim("absent row", "speedup", 2.0, where={"micro_batch": 99}),
]


def test_paper_claims_held_not_held_and_not_measured() -> None:
    v = paper.evaluate(CLAIMS, ROWS)
    assert [x.held for x in v] == [True, False, None, True, None]
    # one measurement without a standard error decides nothing
    assert [x.status for x in v] == ["undetermined (1 run)"] * 2 + ["not measured",
                                                                    "undetermined (1 run)", "not measured"]
    assert [x.verdict for x in v] == [None] * 5
    assert v[0].measured == pytest.approx(1.19) and v[0].ours_over_paper == pytest.approx(1.19 / 1.16)
    assert v[2].ours_over_paper is None
    assert "paper 1.16, ours 1.19" in v[0].line() and "undetermined (1 run)" in v[1].line()
    assert v[0].line().startswith("[Table 3]")
    d = v[3].as_dict()
    assert d["held"] is True and d["claimed"] == "< 1" and d["paper"] == pytest.approx(0.7205, abs=1e-4)
    # an ordering that holds only with equality
    eq = paper.PaperClaim("no slower", "speedup", None, ">=", 1.0, where={"micro_batch": 1})
    assert paper.evaluate([eq], [{"micro_batch": 1, "speedup": 1.0}])[0].held is True
    same = paper.PaperClaim("identical FLOPs", "flops_ratio", 1.0, "==", 1.0)
    assert [v.held for v in paper.evaluate([same], [{"flops_ratio": 1.0}])] == [True]
    assert [v.held for v in paper.evaluate([same], [{"flops_ratio": 0.999}])] == [False]
    with pytest.raises(ValueError):
        paper.PaperClaim("bad", "x", 1.0, relation="!=")


def test_annotate_puts_the_paper_value_beside_the_measured_column() -> None:
    rows = [dict(r) for r in ROWS]
    paper.annotate(rows, CLAIMS)
    assert rows[0]["paper_speedup"] == 1.16 and rows[1]["paper_speedup"] == 1.04
    assert rows[2]["paper_speedup"] is None and rows[3]["paper_act_vs_vanilla"] == pytest.approx(0.7205, abs=1e-4)
    assert all("paper_speedup" in r for r in rows)  # every row has the column


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------
def test_write_report_writes_json_markdown_and_a_titled_png(tmp_path: Path) -> None:
    meta = {"machine": "CPU (test box, 2 cores)", "date": "2026-11-23T12:34:56", "tp": 2}
    verdicts = paper.evaluate(CLAIMS[:2], ROWS)
    fig, axes = report.new_figure(1)
    report.grouped_bars(axes, ["bz=1", "bz=4"], {"speedup": [1.19, 0.97]}, {"speedup": [0.1, None]},
                        color=lambda label: "tab:green")
    written = report.write_report(tmp_path / "t3.json", ROWS[:2], meta, "Table 3 grouping", ["bz", "speedup"],
                                  [[1, "1.19x"], [4, "0.97x"]], verdicts, figure=fig, notes=["a note"])
    assert set(written) == {"json", "md", "png"} and all(p.exists() for p in written.values())
    data = json.loads(written["json"].read_text())
    assert data["meta"] == meta and data["rows"] == ROWS[:2]
    assert [p["held"] for p in data["paper"]] == [True, False] and data["paper"][0]["paper"] == 1.16
    md = written["md"].read_text()
    assert md.startswith("<!-- written by nanotron_ext.bench.report -->\n# Table 3 grouping")  # the marker line
    assert "| bz | speedup |" in md and "| 4 | 0.97x |" in md
    assert "## Paper vs measured" in md and "undetermined (1 run)" in md and "a note" in md
    title = fig._suptitle.get_text()
    assert "Table 3 grouping" in title and "CPU (test box, 2 cores)" in title and "2026-11-23" in title
    import matplotlib.image

    assert matplotlib.image.imread(str(written["png"])).ndim == 3  # a real PNG


def test_write_rows_json_and_csv(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": {"x": 2}}, {"a": 3, "c": None}]
    js = report.write_rows(tmp_path / "t.json", rows, {"machine": "m"})
    assert json.loads(js.read_text()) == {"written_by": "nanotron_ext.bench.report", "meta": {"machine": "m"},
                                          "rows": rows}
    cs = report.write_rows(tmp_path / "t.csv", rows)
    got = list(csv.DictReader(cs.open()))
    assert got[0]["a"] == "1" and json.loads(got[0]["b"]) == {"x": 2} and got[1]["c"] == ""
    assert oct(js.stat().st_mode & 0o777) == "0o644"


def test_format_and_markdown_tables() -> None:
    text = report.format_table(["name", "value"], [["a", 1], ["long name", None]])
    lines = text.splitlines()
    assert len({len(ln) for ln in lines}) == 1
    assert lines[3].rstrip().endswith("-")
    md = report.markdown_table(["a", "b|c"], [[1, None]])
    assert md.splitlines() == ["| a | b\\|c |", "|---|---|", "| 1 | - |"]


def test_figure_title_and_run_meta_name_the_machine_and_date() -> None:
    meta = report.run_meta({"tp": 2})
    assert meta["tp"] == 2 and meta["machine"] and len(meta["date"]) == 19
    title = report.figure_title("Fig", meta)
    assert meta["machine"] in title and meta["date"][:10] in title
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(report.__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    if head:  # a git checkout (CI clones one): the result names the commit it ran from
        assert meta["commit"].split("+")[0] == head[:12] and meta["commit"] in (head[:12], head[:12] + "+modified")


# ------------------------------------------------------------------------------------------------
# launching and workloads
# ------------------------------------------------------------------------------------------------
def test_split_argv_and_torchrun_command() -> None:
    assert launch.split_argv(["--iters", "3", "--", "--nproc_per_node", "8"]) == (["--iters", "3"],
                                                                                  ["--nproc_per_node", "8"])
    assert launch.split_argv(["--iters", "3"]) == (["--iters", "3"], [])
    cmd = launch.torchrun_command([], "x.py", ["--worker"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[4:6] == ["--nproc_per_node", "2"] and cmd[-2:] == ["x.py", "--worker"]
    assert "--standalone" not in launch.torchrun_command(["--nnodes", "2", "--rdzv-endpoint=h:1"], "x.py", [])


def test_last_error_line_picks_the_exception() -> None:
    tail = "starting\nTraceback\n  File \"x.py\", line 1\nValueError: bad shape\n[rank0] exited"
    assert launch.last_error_line(tail) == "ValueError: bad shape"
    assert launch.last_error_line("") == "no output"


def test_shape_overrides_default_only_without_a_config_file() -> None:
    keys = {k: None for k in workload.SHAPE_KEYS}
    plain = workload.shape_overrides(SimpleNamespace(config_file=None, **keys))
    assert f"model.hidden_size={workload.BENCH_DEFAULTS['hidden']}" in plain
    assert f"model.num_kv_heads={workload.BENCH_DEFAULTS['heads']}" in plain
    assert not any(o.startswith("model.low_rank.rank") for o in plain)
    cfg = workload.resolve_config(None, plain)
    assert cfg.model.hidden_size == workload.BENCH_DEFAULTS["hidden"]
    with_file = workload.shape_overrides(SimpleNamespace(config_file="x.yaml", **{**keys, "micro_batch": 1}))
    assert with_file == ["tokens.micro_batch_size=1"]


def test_saved_tensor_bytes_counts_saved_storages_and_checkpoint_inputs() -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with workload.SavedTensorBytes(model) as plain:
        model(x).sum().backward()
    # x (5x8), tanh output (5x16), saved once each; weights are not counted
    assert plain.bytes == (5 * 8 + 5 * 16) * 4
    owner = SimpleNamespace(checkpoint=checkpoint)  # stands for a module that calls `checkpoint`
    inner = {"h": torch.randn(5, 8)}  # an input the frame keeps in a dict, which the hook does not see
    with workload.SavedTensorBytes(model, [owner]) as ck:
        owner.checkpoint(lambda d: model(d["h"]), inner, use_reentrant=False).sum().backward()
    assert owner.checkpoint is checkpoint  # restored on exit
    assert ck.bytes >= 5 * 8 * 4


def test_a_value_only_claim_is_shown_not_judged() -> None:
    c = paper.PaperClaim("Eff, 7B GPU (MB/ms)", "eff", 113.7, relation=None, where={"s": "vanilla"})
    (v,) = paper.evaluate([c], [{"s": "vanilla", "eff": 0.8}])
    assert v.held is None and v.status == "value only" and "claimed" not in v.line()
    assert paper.verdict_table([v])[1][0][-2:] == ["-", "value only"]


def test_an_ordering_inside_two_standard_errors_is_flagged_as_noise() -> None:
    c = paper.PaperClaim("btp vs full rank", "speedup", 1.91, ">", 1.0, where={"n": "btp"}, err_column="speedup_err")
    (v,) = paper.evaluate([c], [{"n": "btp", "speedup": 1.05, "speedup_err": 0.04}])
    assert v.held is True and v.within_noise and v.status == "undetermined (within 2 s.e.)" and v.verdict is None
    # outside the noise but a third of the paper's effect (0.35 of 0.91): the direction only
    (v,) = paper.evaluate([c], [{"n": "btp", "speedup": 1.35, "speedup_err": 0.03}])
    assert v.status == "held in direction only" and v.as_dict()["measured_err"] == 0.03 and v.verdict is True
    assert v.effect_vs_paper == pytest.approx(0.35 / 0.91) and "ours/paper 0.707" in v.line() and "+- 0.03" in v.line()
    (v,) = paper.evaluate([c], [{"n": "btp", "speedup": 1.8, "speedup_err": 0.03}])
    assert v.status == "held"
    (v,) = paper.evaluate([c], [{"n": "btp", "speedup": 0.8, "speedup_err": 0.03}])
    assert v.status == "NOT held" and v.verdict is False


def test_a_deterministic_quantity_is_decided_by_one_measurement() -> None:
    c = paper.PaperClaim("volume vs full rank", "ratio", 0.875, "<", 1.0, exact=True)
    (v,) = paper.evaluate([c], [{"ratio": 0.877}])
    assert v.status == "held" and v.verdict is True
    c = paper.PaperClaim("speedup", "speedup", 16.4, ">", 1.0, exact=True)
    (v,) = paper.evaluate([c], [{"speedup": 1.24}])
    assert v.status == "held in direction only" and "ours/paper 0.0756" in v.line()


def test_run_training_reuses_only_a_finished_run_of_the_same_resolved_config(tmp_path) -> None:
    import json

    from nanotron_ext.bench.training import _finished_with
    from nanotron_ext.config.loader import load_config, save_config

    cfg_file = "examples/config_tiny_llama.yaml"
    sets = [f"general.output_dir={tmp_path}", "general.run=r", "tokens.train_steps=7"]
    out = tmp_path / "r"
    out.mkdir()
    assert not _finished_with(out, cfg_file, sets)  # nothing there
    save_config(load_config(cfg_file, sets), out / "config.yaml")
    (out / "summary.json").write_text(json.dumps({"steps": 7}))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")  # a finished run has its records
    assert _finished_with(out, cfg_file, sets)
    assert not _finished_with(out, cfg_file, sets[:-1] + ["tokens.train_steps=8"])  # another config
    (out / "summary.json").write_text(json.dumps({"steps": 3}))
    assert not _finished_with(out, cfg_file, sets)  # stopped early


def test_a_no_difference_claim_is_decided_by_the_noise() -> None:
    c = paper.PaperClaim("Grassmann vs none", "delta", 0.0, "~", 0.0, err_column="se")
    assert [v.status for v in paper.evaluate([c], [{"delta": 0.01, "se": 0.01}])] == ["held"]
    assert [v.status for v in paper.evaluate([c], [{"delta": 0.05, "se": 0.01}])] == ["NOT held"]
    assert [v.status for v in paper.evaluate([c], [{"delta": 0.0}])] == ["undetermined (1 run)"]
