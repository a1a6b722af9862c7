"""The README's folder tree and ARCHITECTURE.md's map name the same folders, and those are the repository's: the
package's sub-packages and the top-level folders git tracks (the two had drifted: the README's tree lacked tests/).
The descriptions may differ (the README is the short one); the folders may not."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Set

ROOT = Path(__file__).resolve().parents[1]
PKG = "nanotron_ext/"


def _folder(name: str) -> str:
    """A folder as named in either document, relative to the repository ("resbm/" in the map's technique row is
    nanotron_ext/resbm/)."""
    name = name.strip().rstrip("/") + "/"
    return name if (ROOT / name).is_dir() or name == PKG else PKG + name


def architecture_folders() -> Set[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rows = text[text.index("## The map"):].split("\n\n")[1].splitlines()[2:]  # the table, past its header
    return {_folder(n) for row in rows if row.startswith("|") for n in re.findall(r"`([^`]+/)`", row.split("|")[1])}


def readme_folders() -> Set[str]:
    text = (ROOT / "README.md").read_text()
    tree = text[text.index("## Layout"):].split("```")[1]
    out = set()
    for line in tree.splitlines():
        m = re.match(r"( *)([\w.-]+/)(?=\s)", line + " ")
        if m:
            out.add(m.group(2) if not m.group(1) else PKG + m.group(2))
    return out


def repository_folders() -> Set[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {f.split("/")[0] + "/" for f in tracked.splitlines() if "/" in f and not f.startswith(".")}
    return top | {f"{PKG}{p.parent.name}/" for p in (ROOT / "nanotron_ext").glob("*/__init__.py")}


def test_the_readme_tree_and_the_architecture_map_name_the_repositorys_folders() -> None:
    actual = repository_folders()
    assert {"nanotron_ext/", "tests/", "nanotron_ext/bench/", "nanotron_ext/resbm/"} <= actual
    for doc, named in (("ARCHITECTURE.md's map", architecture_folders()), ("README.md's tree", readme_folders())):
        assert named == actual, f"{doc}: missing {sorted(actual - named)}, not in the tree {sorted(named - actual)}"
