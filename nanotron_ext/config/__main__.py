"""Inspect the run configuration from the command line.

    python -m nanotron_ext.config show [--config-file X.yaml] [--set key=value ...]
        print the resolved config (defaults, file, overrides) as YAML
    python -m nanotron_ext.config doc
        print every section and key with its type, default and meaning
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import textwrap
import typing
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from nanotron_ext.config.compose import composed
from nanotron_ext.config.loader import (
    add_config_args,
    config_from_args,
    config_to_yaml,
    describe,
    section_doc,
)
from nanotron_ext.config.schema import Config, ConfigError
from nanotron_ext.config.yaml_io import dump_yaml
from nanotron_ext.registry import techniques


def _sections(cls: type, path: str = "") -> Iterator[Tuple[str, type]]:
    """(dotted path, class) of every section below `cls` (technique sections included), each parent before
    its children."""
    cls = composed(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub = f"{path}.{f.name}" if path else f.name
            yield sub, tp
            yield from _sections(tp, sub)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    # Shown as it would be written in the YAML file; a plain scalar document ends with "...".
    return dump_yaml(value, flow=True).removesuffix("...\n").strip()


def render_doc(width: Optional[int] = None) -> str:
    """Every section's keys as a table (key, type, default), each key's meaning wrapped below it."""
    width = width or max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    out: List[str] = [
        "Run configuration: every key with its type, default and meaning.",
        "Set keys in the YAML file given by --config-file (one mapping per section), or on the",
        "command line with --set section.key=value (value parsed as YAML, e.g. --set optimizer.lr=3e-4).",
    ]
    owners = {path: t.name for t in techniques() for path in t.sections}
    for path, cls in _sections(Config):
        head = f"[{path}]" + (f" (technique {owners[path]})" if path in owners else "")
        intro = section_doc(cls)
        out += ["", head + (f"  {' '.join(intro.split())}" if intro else "")]
        hints = typing.get_type_hints(composed(cls))
        fields = {f.name: f for f in dataclasses.fields(composed(cls)) if f.init}
        rows = []
        for name, type_text, doc in describe(cls):
            if dataclasses.is_dataclass(hints[name]):
                rows.append((name, type_text, f"see [{path}.{name}]", doc))
            else:
                rows.append((name, type_text, _default_text(fields[name]), doc))
        w_name = max(len("key"), *(len(r[0]) for r in rows))
        w_type = max(len("type"), *(len(r[1]) for r in rows))
        out.append(f"  {'key':<{w_name}}  {'type':<{w_type}}  default")
        for name, type_text, default, doc in rows:
            out.append(f"  {name:<{w_name}}  {type_text:<{w_type}}  {default}".rstrip())
            if doc:
                out += textwrap.wrap(" ".join(doc.split()), width=width, initial_indent=" " * 6,
                                     subsequent_indent=" " * 6, break_on_hyphens=False)
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_ext.config", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML")
    add_config_args(show, required=False)
    sub.add_parser("doc", help="print every section/key with type, default and meaning")
    args = parser.parse_args(argv)
    if args.command == "doc":
        sys.stdout.write(render_doc())
        return 0
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
