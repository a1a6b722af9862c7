"""Optional extras in tests: a test of an extra's path skips where the extra is not installed, and fails where the
run says it is (the Makefile passes dev plus `make test EXTRAS=...` on as NANOTRON_EXT_EXTRAS; dev includes eval):
a skipped test there would hide a documented path that no run executes."""
from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

EXTRAS_ENV = "NANOTRON_EXT_EXTRAS"


def installed_extras() -> set:
    named = {e.strip() for e in os.environ.get(EXTRAS_ENV, "").split(",") if e.strip()}
    return named | (dev_extras() if "dev" in named else set())


def dev_extras() -> set:
    """The extras of this package that the dev extra (the test set-up) pulls in, read from pyproject.toml (by pattern:
    tomllib needs Python 3.11, the package supports 3.10)."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*?)\]$", text, re.M | re.S)
    own = re.findall(r'"nanotron_ext\[([^\]]*)\]"', dev.group(1)) if dev else []
    return {e.strip() for group in own for e in group.split(",")}


def require(module: str, extra: str) -> ModuleType:
    """`module`, imported; a skip without it, unless this run installed `extra` (then the ImportError fails the
    test)."""
    if extra in installed_extras():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"the {extra!r} extra is not installed (make setup EXTRAS={extra})")
