"""Issue 41, commands that read a run: eval / generate of a run still training failed with a bare "[Errno 2]" when
checkpoints.keep_last pruned the checkpoint they were reading; generate's advice for a damaged --tokenizer was to
delete the user's own file (eval's was a traceback); a prompt that is not UTF-8 was a traceback; and a run whose
worker was killed after summary.json was written had no loss.png, which the relaunch never drew."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.helpers.runs import corpus_overrides, prepare_corpus, run_overrides, train_worker, write_corpus

pytestmark = pytest.mark.slow  # a trained run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """A 2-step run on one process with a checkpoint per step (keep_last 2: step_1 and step_2)."""
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("live")
    write_corpus(root / "corpus.jsonl")
    base = corpus_overrides(root / "corpus.jsonl", root / "prepared")
    prepare_corpus(base)
    sets = run_overrides(base, root / "out", 1, 1) + ["checkpoints.interval=1", "checkpoints.keep_last=2"]
    run_distributed(train_worker, 1, sets)
    return {"root": root, "sets": sets}


def _copy(trained: Dict[str, Any], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(trained["root"] / "out", out)
    return out


def _eval(out: Path, *args: str) -> int:
    from nanotron_ext.eval import main

    return main(["--run", str(out / "run"), "--checkpoints", str(out / "ckpt"), "--data",
                 str(out.parent / "corpus.jsonl"), *args])


def _prune_while_reading(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> List[Path]:
    """When the first shard is read, the run writes step_3 and keep_last deletes step_2 (a rename stands in)."""
    import nanotron_ext.inference.run as run_module

    real, read = run_module._read_shard, []

    def pruning(shards: Dict[str, Any], name: str) -> Dict[str, Any]:
        if not read:
            newer = ckpt / "step_3"
            os.rename(ckpt / "step_2", newer)
            meta3 = json.loads((newer / "meta.json").read_text())
            (newer / "meta.json").write_text(json.dumps({**meta3, "step": 3}))
        read.append(Path(shards[name][0]).parent)  # the checkpoint folder the shard is read from
        return real(shards, name)

    monkeypatch.setattr(run_module, "_read_shard", pruning)
    return read


def test_eval_of_a_live_run_says_why_its_checkpoint_went_and_reads_the_newest(trained, tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    # "error: .../step_2/pp0_dp0_tp0.pt: [Errno 2] No such file or directory: ..." and no scores
    out = _copy(trained, tmp_path)
    shutil.copy(trained["root"] / "corpus.jsonl", tmp_path / "corpus.jsonl")
    read = _prune_while_reading(monkeypatch, out / "ckpt")
    assert _eval(out) == 0
    captured = capsys.readouterr()
    assert (f"checkpoint {out / 'ckpt' / 'step_2'} was deleted while it was read: the run is still training and "
            "removes its older checkpoints (checkpoints.keep_last=2); reading the newest checkpoint instead") in \
        captured.err, captured.err
    assert f"{out / 'run'} step 3 on " in captured.out and read[-1] == out / "ckpt" / "step_3"


def test_eval_of_a_pruned_step_says_why_and_what_to_do(trained, tmp_path: Path, monkeypatch, capsys) -> None:
    out = _copy(trained, tmp_path)
    shutil.copy(trained["root"] / "corpus.jsonl", tmp_path / "corpus.jsonl")
    _prune_while_reading(monkeypatch, out / "ckpt")
    assert _eval(out, "--step", "2") == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {out / 'ckpt' / 'step_2'} was deleted while it was read: the run is still training and "
        "removes its older checkpoints (checkpoints.keep_last=2); choose a newer --step, or leave --step out to read "
        "the newest\n")


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_damaged_tokenizer_flag_is_never_to_be_deleted(trained, tmp_path: Path, capsys, command: str) -> None:
    # generate: "...; delete it and re-run prepare into a fresh data.prepared_dir": the user's own file. eval: a
    # tokenizers Exception traceback after the model was gathered
    import importlib

    tok = tmp_path / "my_tokenizer.json"
    tok.write_text("garbage\n")
    out = trained["root"] / "out"
    args = ["--run", str(out / "run"), "--checkpoints", str(out / "ckpt"), "--tokenizer", str(tok)]
    args += ["--prompt", "The"] if command == "generate" else ["--data", str(trained["root"] / "corpus.jsonl")]
    assert importlib.import_module(f"nanotron_ext.{command}").main(args) == 2
    assert capsys.readouterr().err == (
        f"error: tokenizer {tok} (--tokenizer) cannot be read (expected value at line 1 column 1); it must be the "
        "tokenizer JSON the run was trained with (pass it with --tokenizer)\n")
    assert tok.read_text() == "garbage\n"


def test_a_prompt_that_is_not_utf8_is_one_line(trained, capsys) -> None:
    # bytes that are not UTF-8 reach Python as surrogates: "TypeError: TextInputSequence must be str" traceback
    from nanotron_ext.generate import main

    out = trained["root"] / "out"
    prompt = os.fsdecode(b"ab\xffc")
    with pytest.raises(SystemExit) as e:  # refused while the arguments are parsed
        main(["--run", str(out / "run"), "--checkpoints", str(out / "ckpt"), "--prompt", prompt])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: --prompt 'ab\\xffc': not valid UTF-8 text (byte 0xff at position 2); "
                                       "give UTF-8 text\n")


def test_the_relaunch_of_a_run_killed_after_its_summary_draws_the_missing_plot(trained, tmp_path: Path) -> None:
    # a worker killed between summary.json and loss.png: the relaunch said the run was complete, no plot ever
    import subprocess

    from tests.helpers.jobs import job_cmd
    from tests.helpers.runs import REPO

    out = _copy(trained, tmp_path)
    sets = [s.replace(str(trained["root"] / "out"), str(out)) for s in trained["sets"]]
    plot, summary = out / "run" / "loss.png", out / "run" / "summary.json"
    plot.unlink()
    before = summary.read_bytes()
    proc = subprocess.run(job_cmd(1, sets), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert plot.exists() and summary.read_bytes() == before
    assert f"{plot} was missing and is drawn again from metrics.jsonl" in proc.stdout, proc.stdout[-2000:]
    assert "is complete" in proc.stdout
