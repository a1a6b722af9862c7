"""The model clock's room (nanotron_ext/bench/clock/): everything outside it imports the clock from the package, never
from its modules, and the clock's datacenter links are parallel/link.py's NCCL collective models (one number)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nanotron_ext.bench.clock import CLOCK_PRESETS, HARDWARE, INFINIBAND, NVLINK3
from nanotron_ext.parallel.link import COLLECTIVE_MODELS

REPO = Path(__file__).resolve().parents[1]
CONSUMERS = ("nanotron_ext", "reproduce", "benchmarks", "scripts")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_code_outside_the_clock_imports_only_its_package() -> None:
    clock = REPO / "nanotron_ext/bench/clock"
    offenders = [f"{path.relative_to(REPO)} imports {name}"
                 for top in CONSUMERS for path in sorted((REPO / top).rglob("*.py"))
                 if clock not in path.parents
                 for name in _imports(path) if name.startswith("nanotron_ext.bench.clock.")]
    assert offenders == []


def test_the_old_homes_are_gone() -> None:
    for old in ("bench/wan/clock.py", "bench/wan/profile.py", "bench/wan/compute_check.py", "bench/hardware.py"):
        assert not (REPO / "nanotron_ext" / old).exists(), old


def _nccl(name: str) -> tuple:
    m = COLLECTIVE_MODELS[name]
    return (m.bus_gbytes_s * 8e3, m.step_us / 1e3, m.base_us / 1e3)


def test_datacenter_links_are_the_collective_models() -> None:
    """The clock's datacenter tiers are parallel/link.py's NCCL collective models (one number for every user)."""
    assert INFINIBAND == pytest.approx(_nccl("infiniband")) and INFINIBAND == pytest.approx((4e5, 0.014, 0.0084))
    assert NVLINK3 == pytest.approx(_nccl("nvlink3")) and NVLINK3 == pytest.approx((1.92e6, 0.0034, 0.0084))
    for p in CLOCK_PRESETS.values():
        assert p.tp == NVLINK3 and p.datacenter_stage == INFINIBAND
    assert HARDWARE["boost-a100-nvlink"].tp == NVLINK3
    assert HARDWARE["boost-a100-nvlink"].stage == _nccl("slingshot11")
