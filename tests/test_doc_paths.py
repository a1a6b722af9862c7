"""Every repository path a page names in backticks exists (tests/test_docs_links.py checks the links; a pointer in
code font is read the same way): docs/status.md and a script's docstring still named files beside reproduce/'s
scripts after the results moved to `<paper>/results/` (issue 55). Placeholders (`<paper>`, `{json,md}`, `$OUT`)
are not paths; a `*` pattern must match something."""
from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
TRACKED_TOPS = ("reproduce/", "benchmarks/", "docs/", "examples/", "nanotron_ext/", "tests/", "scripts/", "patches/")


def pages() -> List[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "reproduce").rglob("README.md"))]


def missing_paths(name: str, text: str) -> List[str]:
    """'name: `path`' for each repository path in backticks in `text` that does not exist."""
    out = []
    for m in re.finditer(r"`([^`\s]+)`", text):
        path = m.group(1).split(":")[0].rstrip(".,;")
        if not path.startswith(TRACKED_TOPS) or any(c in path for c in "<>{}$()"):
            continue
        found = glob.glob(str(ROOT / path)) if "*" in path else (ROOT / path).exists()
        if not found:
            out.append(f"{name}: `{path}`")
    return out


def test_every_path_a_page_names_exists() -> None:
    bad = [line for page in pages() for line in missing_paths(str(page.relative_to(ROOT)), page.read_text())]
    assert not bad, "\n".join(bad)


OUTPUT_FLAG = re.compile(r"(--out|--from-json|--json|--merge)\s+(reproduce/[^\s`'\"),;]+)")


def old_layout_outputs(name: str, text: str) -> List[str]:
    """A script's result written or read at reproduce/<paper>/<file> instead of reproduce/<paper>/results/ (the layout
    since issue 52: results in `<paper>/results/`, reproduce/results/ for the cross-paper ones)."""
    return [f"{name}: {m.group(1)} {m.group(2)}" for m in OUTPUT_FLAG.finditer(text) if "/results/" not in m.group(2)]


def test_results_named_by_commands_are_in_a_results_folder() -> None:
    sources = pages() + sorted((ROOT / "reproduce").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    bad = [line for f in sources for line in old_layout_outputs(str(f.relative_to(ROOT)), f.read_text())]
    assert not bad, "\n".join(bad)
    assert old_layout_outputs("x", "--out reproduce/het_sparseloco/cpu_sweep --from-json reproduce/wan/results/a.json"
                              ) == ["x: --out reproduce/het_sparseloco/cpu_sweep"]


def test_a_stale_pointer_is_found() -> None:
    text = ("old: `reproduce/boost/h200_table3_*`, new: `reproduce/boost/results/h200_table3_*`, "
            "placeholder: `reproduce/<paper>/results/`, a file: `docs/status.md`")
    assert missing_paths("page", text) == ["page: `reproduce/boost/h200_table3_*`"]
