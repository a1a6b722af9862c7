"""reproduce/paper_scale.py (issues 53, 54): `--from-json` checks the whole saved result and refuses a damaged one in
one line naming the file and the key (exit 2); the committed table counts every statement once, judges a statement
by its parts' mean miss (opposite misses do not cancel), and lists every published figure it does not predict."""
from __future__ import annotations

import copy
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SAVED = REPO / "reproduce" / "results" / "PAPER_SCALE.json"


def _saved() -> Any:
    return json.loads(SAVED.read_text())


def test_the_committed_result_passes_the_check_and_renders() -> None:
    from nanotron_ext.cli_checks import JsonFile
    from reproduce.paper_scale import render
    from reproduce.paper_scale_saved import checked

    result = checked(JsonFile(SAVED, "--from-json"), _saved())
    assert "Rows that need no GPU kernel timings" in render(result)


def _set(path: str, value: Any) -> Callable[[Any], None]:
    def damage(result: Any) -> None:
        *parents, last = path.split(".")
        obj = result
        for part in parents:
            obj = obj[int(part)] if part.isdigit() else obj[part]
        if value is KeyError:
            del obj[int(last) if last.isdigit() else last]
        else:
            obj[int(last) if last.isdigit() else last] = value
    return damage


@pytest.mark.parametrize("damage,key", [
    (_set("rows.3.ratio", KeyError), "rows[3].ratio is missing"),
    (_set("rows.3.ratio", "0.97"), "rows[3].ratio is a JSON string"),
    (_set("rows.7.parts.1.paper", None), "rows[7].parts[1].paper is "),
    (_set("rows.0.spread", [1.0]), "rows[0].spread has 1 entries"),
    (_set("fits.resbm.tflops", -1), "fits.resbm.tflops is -1"),
    (_set("cpu", KeyError), "cpu is missing"),
    (_set("curves.resbm_gain.muon", [1.0, 2.0]), "curves.resbm_gain.muon has 2 points"),
    (_set("not_predicted.2.why", 3), "not_predicted[2].why is a JSON number"),
    (_set("measured", KeyError), "measured is missing"),
])
def test_a_damaged_saved_result_is_one_line_naming_the_file_and_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture, damage: Callable[[Any], None], key: str) -> None:
    from reproduce import paper_scale

    result = copy.deepcopy(_saved())
    damage(result)
    bad = tmp_path / "PAPER_SCALE.json"
    bad.write_text(json.dumps(result))
    with pytest.raises(SystemExit) as exit_:
        paper_scale.main(["--from-json", str(bad)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and str(bad) in err and key in err, err


def test_statements_count_once_and_their_misses_do_not_cancel() -> None:
    """Every row's error is |ratio - 1|, or for a statement the mean of its parts' (the right panel of BOOST Fig. 6:
    1.59x and 0.88x do not make a hit); the summaries are recomputed here from the rows."""
    result = _saved()
    predicted = [r for r in result["rows"] if r["predicted"]]
    for r in predicted:
        want = statistics.fmean(abs(p["ratio"] - 1) for p in r["parts"]) if r["parts"] else abs(r["ratio"] - 1)
        assert r["error"] == pytest.approx(want)
        if r["parts"]:
            assert r["ratio"] == pytest.approx(math.exp(statistics.fmean(math.log(p["ratio"]) for p in r["parts"])))
    assert result["median_abs_error"] == pytest.approx(statistics.median(r["error"] for r in predicted))
    cpu = [r for r in predicted if not r["gpu_kernels"]]
    assert result["cpu"]["predicted"] == len(cpu)
    assert result["cpu"]["within_25"] == sum(r["error"] <= 0.25 for r in cpu)
    sentences = [r for r in result["rows"] if "Fig. 6" in r["source"] and "(right)" in r["label"]]
    assert len(sentences) == 1 and len(sentences[0]["parts"]) == 6  # one sentence, one row


def test_every_omitted_published_figure_is_listed_with_its_reason() -> None:
    listed = " ".join(n["source"] + " " + n["what"] for n in _saved()["not_predicted"])
    for figure in ("Protocol Models Table 2", "sec. 8.5", "1.46-1.91x", "decentralised (uncompressed)"):
        assert figure in listed, figure
