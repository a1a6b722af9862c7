"""Issue 33 rows 7 and 8: a config file that is not a config (10 MB of keys or of one value, nested 10,000 deep,
/dev/zero, a FIFO, a folder, not UTF-8) is refused at once with one line naming the file and exit code 2; it used
to keep `config show` and training busy for minutes, or end in a RecursionError / MemoryError traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from tests.helpers.runs import REPO

LIMIT = "more than the 262,144 a config may have (a run config is a few KB); is it the right file?"


def _one_line(args: List[str], module: str = "nanotron_ext.config") -> str:
    # 60 s: the old code took 49 s (nesting), 82 s (/dev/zero) and > 120 s (10 MB) to fail, if it failed
    got = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert got.returncode == 2, (got.returncode, got.stdout[-500:], got.stderr[-2000:])
    return got.stderr.splitlines()[0]


def _show(path: Path | str) -> str:
    return _one_line(["show", "--config-file", str(path)])


def test_a_10_mb_config_of_keys_or_of_one_value_is_refused_unread(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("".join(f"key{i}: {i}\n" for i in range(700_000)))
    value = tmp_path / "value.yaml"
    value.write_text("general:\n  run: " + "x" * 10_000_000 + "\n")
    for path in (keys, value):
        assert _show(path) == f"error: config file {path} is {path.stat().st_size:,} bytes, {LIMIT}"


@pytest.mark.parametrize("text", ["model: " + "[" * 10_000 + "]" * 10_000 + "\n",
                                  "model: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n"], ids=["list", "mapping"])
def test_a_config_nested_10000_deep_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    # the 33rd level (the document's mapping is the 1st): the 32nd `[`, or the key inside the 31st `{`
    column = 7 + 32 if text[7] == "[" else 7 + 4 * 30 + 2
    assert _show(path) == (f"error: {path}: invalid YAML at line 1, column {column}: values nested more than "
                           "32 deep, far beyond any config")


def test_dev_zero_a_fifo_and_a_folder_are_refused_before_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # opening it would block until a writer came
    # (--config-file is checked when the arguments are parsed; load_config checks a path from code the same way)
    assert _show("/dev/zero") == "error: --config-file /dev/zero is a character device, not a file; a file is expected"
    assert _show(fifo) == f"error: --config-file {fifo} is a named pipe, not a file; a file is expected"
    assert _show(tmp_path) == f"error: --config-file {tmp_path} is a folder; a file is expected"


def test_a_config_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("general:\n  run: caf\u00e9\n".encode("latin-1"))
    assert _show(path) == (f"error: config file {path} is not UTF-8 text (byte 0xe9 at offset 19); a YAML "
                           "config is text")


def test_the_training_launcher_refuses_dev_zero_before_any_process_group(tmp_path: Path) -> None:
    line = _one_line(["--nproc_per_node=1", "-m", "nanotron_ext.train", "--config-file", "/dev/zero"],
                     module="nanotron_ext.launch")
    assert line == "error: --config-file /dev/zero is a character device, not a file; a file is expected"


def test_thousands_of_unknown_keys_list_ten() -> None:
    from nanotron_ext.config.checks import ConfigError
    from nanotron_ext.config.loader import Config, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict(Config, {f"key{i}": i for i in range(20_000)})
    lines = str(e.value).splitlines()
    assert lines[:2] == ["key0: unknown key", "key1: unknown key"]
    assert len(lines) == 12 and lines[10] == "... and 19,990 more unknown keys in the top level"
    assert lines[11].startswith("allowed top-level keys: general, parallelism, model,")
