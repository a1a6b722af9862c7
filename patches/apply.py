#!/usr/bin/env python3
"""Apply the nanotron_ext patch series to the installed nanotron, idempotently.

Usage: python patches/apply.py [--check] [--target DIR]

--target DIR patches the `nanotron` package inside DIR instead of the installed one (tests use
this on temporary copies).

Each patch in `series` is applied with `patch -p1` inside the directory that holds the installed
`nanotron` package. A patch that already reverses cleanly is skipped, so running this twice is a
no-op. Afterwards a stamp file (`nanotron/NANOTRON_EXT_PATCHES`) records each patch's name and
sha256; `nanotron_ext` refuses to import unless the stamp matches this series.
Written by hand because no packaging tool patches an installed wheel in place.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
    cmd = ["patch", "-p1", "-s", "-f", "-d", str(root), "-i", str(patch), *flags]
    return subprocess.run(cmd, capture_output=True).returncode == 0


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
    parser.add_argument("--target", type=Path, help="directory holding the `nanotron` package (default: the installed one)")
    args = parser.parse_args()
    sys.exit(apply(check_only=args.check, target=args.target))
