"""Issue 53 item 2: every `torch.load` in the repository reads with `weights_only=True`. A full unpickler runs any
code a file names (a checkpoint, a tape, a result someone handed over); the scan names each call site that could,
as file:line, so a new one fails here instead of in review."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List

REPO = Path(__file__).resolve().parents[1]
# every folder of the repository with Python in it (.venv, data and build outputs are not the repository's)
FOLDERS = ("nanotron_ext", "benchmarks", "reproduce", "scripts", "tests", "patches", "examples")


def _python_files() -> Iterator[Path]:
    for folder in FOLDERS:
        yield from sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)
    yield from sorted(REPO.glob("*.py"))


def _is_torch_load(func: ast.expr) -> bool:
    """torch.load(...) and torch.serialization.load(...), however torch was imported as a module."""
    if not isinstance(func, ast.Attribute) or func.attr != "load":
        return False
    owner = func.value
    if isinstance(owner, ast.Attribute) and owner.attr == "serialization":
        owner = owner.value
    return isinstance(owner, ast.Name) and owner.id == "torch"


def unsafe_loads(source: str, name: str) -> List[str]:
    """file:line of each torch.load call in `source` without a literal `weights_only=True`."""
    out = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.Call) and _is_torch_load(node.func):
            flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                out.append(f"{name}:{node.lineno}")
    return out


def test_the_scan_finds_what_it_looks_for() -> None:
    """The scan itself can fail: the forms it must catch, and the one it must pass."""
    bad = ("import torch\ntorch.load(f)\ntorch.load(f, weights_only=False)\ntorch.serialization.load(f)\n"
           "torch.load(f, weights_only=flag)\n")
    assert unsafe_loads(bad, "x.py") == ["x.py:2", "x.py:3", "x.py:4", "x.py:5"]
    assert unsafe_loads("torch.load(f, map_location='cpu', weights_only=True)\n", "x.py") == []


def test_every_torch_load_reads_weights_only() -> None:
    files = list(_python_files())
    assert len(files) > 100 and REPO / "benchmarks" / "discrete_codec_sensitivity.py" in files
    found = [hit for p in files for hit in unsafe_loads(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert not found, ("torch.load without weights_only=True (a full unpickler runs whatever the file names): "
                       + ", ".join(found))
