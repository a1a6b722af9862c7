#!/usr/bin/env python3
"""Apply the nanotron_ext patch series to the installed nanotron, idempotently.

Usage: python patches/apply.py [--check] [--target DIR]

--target DIR patches the `nanotron` package inside DIR instead of the installed one (tests use
this on temporary copies).

Each patch in `series` is applied with `patch -p1` inside the directory that holds the installed
`nanotron` package (where GNU patch is not installed, by an exact-context applier in this file).
A patch that already reverses cleanly is skipped, so running this twice is a no-op.
Afterwards a stamp file (`nanotron/NANOTRON_EXT_PATCHES`) records each patch's name and sha256;
`nanotron_ext` refuses to import unless the stamp matches this series.
Written by hand because no packaging tool patches an installed wheel in place.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PATCH_DIR = Path(__file__).resolve().parent
STAMP_NAME = "NANOTRON_EXT_PATCHES"


def series() -> list[Path]:
    names = [line.strip() for line in (PATCH_DIR / "series").read_text().splitlines()]
    return [PATCH_DIR / name for name in names if name and not name.startswith("#")]


def stamp_text() -> str:
    return "".join(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in series())


def nanotron_root() -> Path:
    spec = importlib.util.find_spec("nanotron")  # does not import it: the unpatched wheel may not import
    if spec is None or not spec.submodule_search_locations:
        sys.exit("nanotron is not installed: pip install nanotron==0.4")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _patch(root: Path, patch: Path, *flags: str) -> bool:
    if shutil.which("patch") is None:  # e.g. a minimal GPU image: the same edit, exact context, in Python
        return _patch_in_python(root, patch, reverse="-R" in flags, dry_run="--dry-run" in flags)
    cmd = ["patch", "-p1", "-s", "-f", "-d", str(root), "-i", str(patch), *flags]
    return subprocess.run(cmd, capture_output=True).returncode == 0


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _hunks(text: str) -> List[Tuple[str, List[Tuple[int, int, List[str], List[str]]]]]:
    """[(path without its first component, [(old start, new start, old lines, new lines)])] of a unified diff."""
    lines, out, i = text.splitlines(keepends=True), [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if line.startswith("+++ "):
            out.append((line[4:].split("\t")[0].strip().split("/", 1)[1], []))
            continue
        m = _HUNK.match(line)
        if not (m and out):
            continue
        old_n, new_n = int(m.group(2) or 1), int(m.group(4) or 1)
        old: List[str] = []
        new: List[str] = []
        while len(old) < old_n or len(new) < new_n:
            body, i = lines[i], i + 1
            if body.startswith("\\"):  # "\ No newline at end of file"
                continue
            tag, body = (" ", body) if body == "\n" else (body[0], body[1:])
            if tag in " -":
                old.append(body)
            if tag in " +":
                new.append(body)
        out[-1][1].append((int(m.group(1)), int(m.group(3)), old, new))
    return out


def _patch_in_python(root: Path, patch: Path, reverse: bool, dry_run: bool) -> bool:
    """Apply (or reverse) `patch` like `patch -p1 -F0`: every hunk's context must match exactly (searched
    outward from its line number); nothing is written unless every hunk of every file applies.
    Written by hand because the standard library has no patch applier; used only without GNU patch."""
    edited: Dict[Path, List[str]] = {}
    for rel, hunks in _hunks(patch.read_text()):
        path = root / rel
        if not path.is_file():
            return False
        lines = edited.setdefault(path, path.read_text().splitlines(keepends=True))
        for old_start, new_start, old, new in hunks:
            if reverse:
                old, new, old_start = new, old, new_start
            at = next((p for d in range(len(lines) + 1) for p in (old_start - 1 - d, old_start - 1 + d)
                       if 0 <= p <= len(lines) - len(old) and lines[p:p + len(old)] == old), None)
            if at is None:
                return False
            lines[at:at + len(old)] = new
    if not dry_run:
        for path, lines in edited.items():
            path.write_text("".join(lines))
    return True


def apply(check_only: bool = False, target: Optional[Path] = None) -> int:
    root = nanotron_root() if target is None else target.resolve()
    if not (root / "nanotron").is_dir():
        sys.exit(f"no nanotron package in {root}")
    missing = []
    for patch in series():
        if _patch(root, patch, "-R", "--dry-run"):
            print(f"  already applied  {patch.name}")
            continue
        if check_only:
            missing.append(patch.name)
            continue
        if not _patch(root, patch, "-N", "--dry-run"):
            sys.exit(f"patch {patch.name} does not apply to {root / 'nanotron'}: is it nanotron==0.4?")
        _patch(root, patch, "-N")
        print(f"  applied          {patch.name}")
    if missing:
        print(f"not applied: {', '.join(missing)}")
        return 1
    (root / "nanotron" / STAMP_NAME).write_text(stamp_text())
    print(f"nanotron at {root / 'nanotron'} carries {len(series())} nanotron_ext patches")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Apply the nanotron_ext patch series to nanotron==0.4.")
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if a patch is not applied")
    parser.add_argument("--target", type=Path,
                        help="directory holding the `nanotron` package (default: the installed one)")
    args = parser.parse_args()
    sys.exit(apply(check_only=args.check, target=args.target))
