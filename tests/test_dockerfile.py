"""What can be checked of the Dockerfile without building it here (no Docker daemon, no GPU):
it installs this package with its declared dependencies, applies the patch set, provides nsys,
and every repository command the profiling section (docs/profiling-and-benchmarks.md, linked from the README) runs
exists."""
from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _run_lines() -> str:
    return re.sub(r"\\\n", " ", DOCKERFILE)


def test_installs_the_project_with_its_declared_dependencies() -> None:
    run = _run_lines()
    assert re.search(r"pip install [^\n]*-e '\.\[dev\]'",
                     run), "the image must install the package itself (pyproject deps)"
    assert "--no-deps" not in run, "installing without deps would skip what pyproject.toml declares"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("nanotron==0.4") for d in deps)
    # the only pin the image adds is torch = the base image's own build, which must satisfy pyproject's bound
    assert "grep -i '^torch=='" in run and "-c /tmp/image-torch.txt" in run


def test_applies_the_patch_series_and_has_nsys() -> None:
    run = _run_lines()
    assert "python patches/apply.py" in run
    assert (REPO / "patches" / "apply.py").exists() and (REPO / "patches" / "series").exists()
    assert "nsys" in run and "nsight-systems-cli" in run


def test_build_context_keeps_what_the_image_needs() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "patches", "nanotron_ext", "examples"):
        assert needed not in ignored and (REPO / needed).exists()


def test_profiling_commands_exist() -> None:
    page = (REPO / "docs" / "profiling-and-benchmarks.md").read_text()
    assert "docs/profiling-and-benchmarks.md" in (REPO / "README.md").read_text(), "the README must link the page"
    section = page[page.index("## Profiling"):]
    section = section[: section.find("\n## ", 4)]
    assert "nsys profile" in section
    for path in re.findall(r"(examples/[\w./-]+\.yaml|reproduce/[\w./-]+\.yaml)", section):
        assert (REPO / path).exists(), path
    assert "-m nanotron_ext.train" in section
