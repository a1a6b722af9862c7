"""What CI runs (.ci/run), read through make itself: README's test command, and no documented path left to a test
that CI skips."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from tests.helpers.extras import dev_extras

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command_which_installs_and_requires_the_eval_extra() -> None:
    """lm-eval on an export (docs/after-training.md) worked with `make setup EXTRAS=eval` but CI never ran its test:
    CI's `make test` installed `.[dev]` without lm-eval, so the test skipped (issue 33 row 10). Now CI's make command
    is README's test command; its dry run (`make -n -B`) installs `.[dev]`, whose extras include eval, and runs
    pytest with NANOTRON_EXT_EXTRAS=dev (the lm-eval test then fails, not skips, without lm-eval)."""
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.startswith("make test")]
    readme = re.search(r"```bash\n(?:.*\n)*?(make test\b[^#\n]*?)\s*#", (REPO / "README.md").read_text())
    assert readme is not None and commands == [readme.group(1).strip()], (commands, readme)
    plan = subprocess.run(["make", "-n", "-B", *shlex.split(commands[0])[1:]], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert any("pip install -q -e '.[dev]'" in line for line in plan), plan
    assert "eval" in dev_extras()
    pytest_lines = [line for line in plan if " -m pytest " in line]
    assert len(pytest_lines) == 1 and pytest_lines[0].startswith("NANOTRON_EXT_EXTRAS=dev "), pytest_lines
