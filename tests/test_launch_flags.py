"""Issue 41: the launchers' own numeric flags are checked before anything starts, each one line naming the flag,
exit code 2: `python -m nanotron_ext.launch --nproc_per_node=-1` was an AssertionError traceback from torch elastic
and `=two` a ValueError traceback; `python -m nanotron_ext.sparseloco.ft_launch --join-timeout-ms -5` torchft's
OverflowError traceback."""
from __future__ import annotations

import pytest

from tests.helpers.runs import TINY

FT = TINY.parent / "config_tiny_sparseloco_ft.yaml"


@pytest.mark.parametrize("value, line", [
    ("-1", "--nproc_per_node -1: must be >= 1 (processes on this node)"),  # an AssertionError traceback
    ("0", "--nproc_per_node 0: must be >= 1 (processes on this node)"),
    ("two", "--nproc_per_node two: must be a count >= 1, or auto, cpu, gpu or xpu"),  # a ValueError traceback
])
def test_the_launchers_process_count_is_checked_first(capsys, value: str, line: str) -> None:
    from nanotron_ext.launch import main

    assert main([f"--nproc_per_node={value}", "-m", "nanotron_ext.train", "--config-file", str(TINY)]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize("value, line", [
    ("-5", "--join-timeout-ms -5: must be >= 0"),  # torchft's OverflowError traceback
    (str(2**64), f"--join-timeout-ms {2**64}: must be < 2^63"),
])
def test_ft_launch_join_timeout_is_checked_before_the_lighthouse(capsys, value: str, line: str) -> None:
    from nanotron_ext.sparseloco.ft_launch import main

    assert main(["--config-file", str(FT), "--join-timeout-ms", value]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
