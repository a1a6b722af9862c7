"""Issue 41: how a stopped launch ends. A second SIGTERM (or Ctrl-C) during the exit was a KeyboardInterrupt
traceback after the "interrupted" line (exit 1); a stopped checkpoints.resume=overwrite launch said "last complete
checkpoint: none" while the earlier run's checkpoint was there, kept (overwrite replaces it only at the new run's
first checkpoint)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, List

import pytest

from tests.helpers.runs import TINY


def _main_with(monkeypatch: pytest.MonkeyPatch, trainer_class: type, sets: List[str]) -> int:
    """nanotron_ext.train's main in this process, its Trainer replaced (signal handlers restored after)."""
    import nanotron_ext.train.__main__ as entry
    import nanotron_ext.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "Trainer", trainer_class)
    monkeypatch.setattr(entry, "_STOP", {"signal": None})
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return entry.main(["--config-file", str(TINY), *[a for s in sets for a in ("--set", s)]])
    except KeyboardInterrupt:  # (pytest would take it for the user's Ctrl-C and end the session)
        raise AssertionError("a KeyboardInterrupt escaped main: the user saw a traceback") from None
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _stop_here(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(5)  # the handler raises KeyboardInterrupt before this ends


def test_a_second_sigterm_during_the_exit_is_no_traceback(tmp_path: Path, monkeypatch, capsys) -> None:
    # the launcher (or the user) repeats the stop while the worker releases its process groups: KeyboardInterrupt
    # traceback out of gc.collect() after the "interrupted" line, exit 1
    import nanotron_ext.train.__main__ as entry

    class NoCheckpoint:
        def last_checkpoint(self) -> None:
            return None

        def earlier_checkpoint(self) -> None:
            return None

    class Stopped:
        step, folder = 4, NoCheckpoint()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def train(self) -> None:
            _stop_here(signal.SIGTERM)

    def release_stopped_again(job: dict) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)

    monkeypatch.setattr(entry, "_release_process_groups", release_stopped_again)
    assert _main_with(monkeypatch, Stopped, [f"checkpoints.dir={tmp_path / 'ckpt'}"]) == 130
    assert capsys.readouterr().err == "interrupted at step 4; last complete checkpoint: none\n"


def _earlier_checkpoint(ckpt: Path, step: int) -> Path:
    path = ckpt / f"step_{step}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "files": []}))
    return path


@pytest.mark.parametrize("when", ["training", "starting"])
def test_a_stopped_overwrite_launch_names_the_earlier_runs_kept_checkpoint(tmp_path: Path, monkeypatch, capsys,
                                                                           when: str) -> None:
    # "last complete checkpoint: none" although the earlier run's step_3 was there, whole (resume=overwrite deletes
    # it only at this run's first checkpoint)
    from nanotron_ext.config import load_config
    from nanotron_ext.train.run_folder import RunFolder

    earlier = _earlier_checkpoint(tmp_path / "ckpt", 3)
    sets = [f"checkpoints.dir={tmp_path / 'ckpt'}", "checkpoints.resume=overwrite", "parallelism.dp=1"]
    folder = RunFolder.__new__(RunFolder)  # (its claim is collective: the state a launch has before its checkpoint)
    folder.cfg, folder._overwrite_pending = load_config(TINY, sets), True

    class Overwriting:
        step = 2

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if when == "starting":
                _stop_here(signal.SIGINT)  # Ctrl-C while the model is built
            self.folder = folder

        def train(self) -> None:
            _stop_here(signal.SIGINT)

    assert _main_with(monkeypatch, Overwriting, sets) == 130
    step = 2 if when == "training" else 0
    assert capsys.readouterr().err == (
        f"interrupted at step {step}; last complete checkpoint: none of this run; the earlier run's {earlier} is kept "
        "with its records (checkpoints.resume=overwrite replaces them only at this run's first checkpoint): launch "
        "with checkpoints.resume=auto to continue it, or with overwrite to start afresh\n")
