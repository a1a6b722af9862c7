"""Inspect the run configuration from the command line.

    python -m nanotron_ext.config show [--config-file X.yaml] [--set key=value ...]
        print the resolved config (defaults, file, overrides) as YAML, then (as comments) which
        bandwidth tier (TP / PP / DP) runs which technique and its bytes per step by closed form
    python -m nanotron_ext.config doc
        print every section and key with its type, default and meaning
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import textwrap
import typing
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Tuple

from nanotron_ext.cli_flags import Parser
from nanotron_ext.config.compose import composed
from nanotron_ext.config.loader import (
    add_config_args,
    config_from_args,
    config_to_yaml,
    describe,
    section_doc,
)
from nanotron_ext.config.schema import Config, ConfigError
from nanotron_ext.config.tiers import replica_codecs, tier_forms
from nanotron_ext.config.yaml_io import dump_yaml
from nanotron_ext.errors import one_line
from nanotron_ext.registry import CODECS, DP_SYNCS, TP_STRATEGIES, techniques

if TYPE_CHECKING:
    from nanotron_ext.metrics.tier_bytes import TierBytes


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


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def form_line(tb: Optional["TierBytes"], what: str) -> str:
    """One closed form's line: the bytes, then the form."""
    if tb is None:
        return f"{what}: no closed form"
    split = f" (forward {_fmt_bytes(tb.forward)}, backward {_fmt_bytes(tb.backward)})" if tb.backward else ""
    return f"{what}: {_fmt_bytes(tb.total)}{split}; {tb.formula}"


def tier_lines(config: Config) -> List[str]:
    """The closed forms' lines: one per distinct (what, closed form) of nanotron_ext.config.tiers.tier_forms."""
    lines = [form_line(tb, what) for entries in tier_forms(config).values() for what, tb in entries]
    return list(dict.fromkeys(lines))


def render_tiers(config: Config) -> str:
    """Which bandwidth tier (TP inside a stage, PP between stages, DP between replicas) runs which technique,
    as YAML comments (the output stays a loadable config). Names come from the registry: the core knows none."""
    p, m = config.parallelism, config.model

    def owner(point: Any, name: str) -> str:
        return f"{name} ({point.owner(name).name})"

    by_codec = replica_codecs(config)
    codecs = ", ".join(f"{owner(CODECS, c)} on replicas {r}" if len(by_codec) > 1 else owner(CODECS, c)
                       for c, (r, _) in by_codec.items())
    boundaries = len(config.codec_boundaries())
    once = "" if p.tp == 1 or p.pp == 1 else (
        "; each wire once over TP" if p.pp_scatter_gather
        else "; one copy per TP rank") + " (parallelism.pp_scatter_gather)"
    lines = [f"tiers: dp={p.dp} x tp={p.tp} x pp={p.pp}",
             f"  TP (inside a stage, {p.tp} ranks): {owner(TP_STRATEGIES, m.tp_strategy)}"
             + (f", low-rank {m.low_rank.kind}" if m.low_rank.kind != "none" else ""),
             f"  PP (between stages, {p.pp - 1} links; {boundaries} codec boundaries): {codecs}{once}"
             + (f"; emulated {p.link.bandwidth_mbps:g} Mbit/s, {p.link.latency_ms:g} ms" if p.link.enabled else ""),
             f"  DP (between replicas, {p.dp}): {owner(DP_SYNCS, p.dp_sync)}"]
    lines += ["closed forms (nanotron_ext.metrics.tier_bytes; the comm ledger's bytes):"]
    lines += [f"  {line}" for line in tier_lines(config)]
    if p.tp > 1 and p.pp > 1 and not p.pp_scatter_gather:
        lines.append(f"  (parallelism.pp_scatter_gather=false: a TP-replicated wire crosses {p.tp} times)")
    return "".join(f"# {line}\n" for line in lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = Parser(prog="python -m nanotron_ext.config", description=__doc__.split("\n\n")[0])
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
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(config))
    sys.stdout.write(render_tiers(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
