"""Optional extras in tests: a test of an extra's path skips where the extra is not installed, and fails where the
run says it is (the Makefile passes `make test EXTRAS=...` on as NANOTRON_EXT_EXTRAS; CI installs the eval extra):
a skipped test there would hide a documented path that no run executes."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

EXTRAS_ENV = "NANOTRON_EXT_EXTRAS"


def installed_extras() -> set:
    return {e.strip() for e in os.environ.get(EXTRAS_ENV, "").split(",") if e.strip()}


def require(module: str, extra: str) -> ModuleType:
    """`module`, imported; a skip without it, unless this run installed `extra` (then the ImportError fails the test)."""
    if extra in installed_extras():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"the {extra!r} extra is not installed (make setup EXTRAS={extra})")
