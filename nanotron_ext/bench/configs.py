"""Generated reproduction configs: write them from their one source, or check the committed files."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional


def write_or_check(expected: Callable[[], Dict[Path, str]], argv: Optional[List[str]], description: str,
                   script: str) -> int:
    """`script [--check]`: write every expected file, or (--check) exit 1 naming the files that differ."""
    from nanotron_ext.cli_flags import Parser

    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare the files with this source instead of writing")
    args = p.parse_args(argv)
    stale = []
    for path, text in expected().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run {script}): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0
