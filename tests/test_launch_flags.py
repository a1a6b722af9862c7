"""Issue 41: the launchers' own numeric flags are checked before anything starts, each one line naming the flag,
exit code 2: `python -m nanotron_ext.launch --nproc_per_node=-1` was an AssertionError traceback from torch elastic
and `=two` a ValueError traceback; `python -m nanotron_ext.sparseloco.ft_launch --join-timeout-ms -5` torchft's
OverflowError traceback."""
from __future__ import annotations

import pytest

from tests.helpers.runs import TINY

FT = TINY.parent / "config_tiny_sparseloco_ft.yaml"


@pytest.mark.parametrize("value, line", [
    ("-1", "--nproc-per-node -1: must be >= 1"),  # an AssertionError traceback
    ("0", "--nproc-per-node 0: must be >= 1"),
    ("two", "--nproc-per-node two: not an integer or one of auto, cpu, gpu, xpu"),  # a ValueError traceback
])
def test_the_launchers_process_count_is_checked_first(capsys, value: str, line: str) -> None:
    from nanotron_ext.launch import main

    with pytest.raises(SystemExit) as e:  # refused while the arguments are parsed
        main([f"--nproc_per_node={value}", "-m", "nanotron_ext.train", "--config-file", str(TINY)])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize("value, line", [
    ("-5", "--join-timeout-ms -5: must be >= 0"),  # torchft's OverflowError traceback
    (str(2**64), f"--join-timeout-ms {2**64}: must be < 2^63"),
])
def test_ft_launch_join_timeout_is_checked_before_the_lighthouse(capsys, value: str, line: str) -> None:
    from nanotron_ext.sparseloco.ft_launch import main

    with pytest.raises(SystemExit) as e:  # refused while the arguments are parsed
        main(["--config-file", str(FT), "--join-timeout-ms", value])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"
