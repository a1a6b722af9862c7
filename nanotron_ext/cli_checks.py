"""Checks every command line runs on its arguments before doing any work: each failure is a UserFacingError
naming the flag and the value (or file), which the entry points print as one line with exit code 2."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from nanotron_ext.errors import UserFacingError

MAX_RESULT_BYTES = 64 * 2**20  # a result JSON is KBs to a few MB; a larger file is not one


class ArgumentError(UserFacingError, ValueError):
    """A command-line value that cannot work; the message names the flag."""


def at_least(flag: str, value: Optional[int], low: int) -> None:
    """An integer flag (None: not given, its default applies) must be >= `low`."""
    if value is not None and value < low:
        raise ArgumentError(f"{flag} {value}: must be >= {low}")


def finite(flag: str, value: float, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> None:
    """A float flag must be a finite number in [low, high] ((low, high] with `low_open`)."""
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ArgumentError(f"{flag} {value}: must be a finite number in {bounds}")


def seed(flag: str, value: int) -> None:
    """A seed flag: what torch's and numpy's generators accept (2^70 was an OverflowError traceback)."""
    from nanotron_ext.config.checks import SEED_LIMIT

    if not 0 <= value < SEED_LIMIT:
        raise ArgumentError(f"{flag} {value}: must be in [0, 2^63)")


def input_file(flag: str, path: str | Path) -> Path:
    """A file the command reads: it must exist and be a file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ArgumentError(f"{flag} {p} does not exist")
    if not p.is_file():
        raise ArgumentError(f"{flag} {p} is a folder; a file is expected")
    return p


def output_file(flag: str, path: str | Path) -> Path:
    """A file the command writes: not an existing folder, and no part of its parent path a file."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ArgumentError(f"{flag} {p} is a folder; give the path of a file to write")
    if p.exists() and not p.is_file():  # an atomic write would put a file in the place of /dev/null
        raise ArgumentError(f"{flag} {p} is not a regular file (a device or a pipe?); give the path of a file to write")
    _parents_are_folders(flag, p)
    return p


def result_file(flag: str, path: str | Path, keys: Sequence[str], writer: str) -> Path:
    """A JSON result the command writes (output_file), which may replace only an earlier result of `writer`: a JSON
    object with every one of `keys`. A run's metrics.jsonl or summary.json named by mistake was overwritten."""
    p = output_file(flag, path)
    if not p.exists():
        return p
    try:
        earlier = json.loads(p.read_text(encoding="utf-8")) if p.stat().st_size <= MAX_RESULT_BYTES else None
    except (OSError, ValueError):
        earlier = None
    if not (isinstance(earlier, dict) and all(k in earlier for k in keys)):
        raise ArgumentError(f"{flag} {p} exists and is not an earlier result of {writer} (a JSON object with "
                            f"{', '.join(keys)}); nothing was written: choose another file")
    return p


def output_folder(flag: str, path: str | Path) -> Path:
    """A folder the command writes: not an existing file, and no part of its parent path a file."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ArgumentError(f"{flag} {p} is a file; give the path of a folder to write")
    _parents_are_folders(flag, p)
    return p


def _parents_are_folders(flag: str, p: Path) -> None:
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArgumentError(f"{flag} {p}: {parent} is a file, not a folder")
            return
