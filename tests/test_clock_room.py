"""The model clock's room (nanotron_ext/bench/clock/): everything outside it imports the clock from the package, never
from its modules, and the clock's datacenter links are the emulator's presets (one number for both)."""
from __future__ import annotations

import ast
from pathlib import Path

from nanotron_ext.bench.clock import CLOCK_PRESETS, HARDWARE, INFINIBAND, NVLINK3
from nanotron_ext.parallel.link import LINK_PRESETS

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


def _mbps_ms(name: str) -> tuple:
    return (LINK_PRESETS[name].bandwidth_mbps, LINK_PRESETS[name].latency_ms)


def test_datacenter_links_are_the_emulators_presets() -> None:
    assert INFINIBAND == _mbps_ms("infiniband") == (4e5, 0.002)
    assert NVLINK3 == _mbps_ms("nvlink3") == (2.4e6, 0.002)  # A100 NVLink 3: 300 GB/s = 2.4 Tbit/s per direction
    for p in CLOCK_PRESETS.values():
        assert p.tp == NVLINK3 and p.datacenter_stage == INFINIBAND
    assert HARDWARE["boost-a100-nvlink"].tp == NVLINK3
    assert HARDWARE["boost-a100-nvlink"].stage == _mbps_ms("slingshot11") == (2e5, 0.002)
