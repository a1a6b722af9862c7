"""Optional extras in tests: a test of an extra's path skips where the extra is not installed, and fails where the
run says it is (the Makefile passes dev plus `make test EXTRAS=...` on as NANOTRON_EXT_EXTRAS; dev includes eval):
a skipped test there would hide a documented path that no run executes."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

EXTRAS_ENV = "NANOTRON_EXT_EXTRAS"


def installed_extras() -> set:
    named = {e.strip() for e in os.environ.get(EXTRAS_ENV, "").split(",") if e.strip()}
    return named | (dev_extras() if "dev" in named else set())


def dev_extras() -> set:
    """The extras of this package that the dev extra (the test set-up) pulls in, read from pyproject.toml."""
    deps = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    own = [d for d in deps if d.startswith("nanotron_ext[")]
    return {e.strip() for d in own for e in d[len("nanotron_ext["):-1].split(",")}


def require(module: str, extra: str) -> ModuleType:
    """`module`, imported; a skip without it, unless this run installed `extra` (then the ImportError fails the test)."""
    if extra in installed_extras():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"the {extra!r} extra is not installed (make setup EXTRAS={extra})")
