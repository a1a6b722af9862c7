"""What CI runs (.ci/run), read through make itself: no documented path is left to a test that CI skips."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_installs_the_eval_extra_and_makes_its_test_required() -> None:
    """lm-eval on an export (README "After training") worked with `make setup EXTRAS=eval` but CI never ran its test:
    CI's `make test` installed `.[dev]` only, so the test skipped (issue 33 row 10). CI's make command, dry-run
    (`make -n -B`), installs `.[dev,eval]` and runs pytest with NANOTRON_EXT_EXTRAS=eval (the lm-eval test then
    fails, not skips, without lm-eval)."""
    commands = [shlex.split(line) for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.startswith("make test")]
    assert len(commands) == 1, commands
    plan = subprocess.run(["make", "-n", "-B", *commands[0][1:]], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.splitlines()
    assert any("pip install -q -e '.[dev,eval]'" in line for line in plan), plan
    pytest_lines = [line for line in plan if " -m pytest " in line]
    assert len(pytest_lines) == 1 and pytest_lines[0].startswith("NANOTRON_EXT_EXTRAS=eval "), pytest_lines
