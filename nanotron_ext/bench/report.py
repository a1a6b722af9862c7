"""Reports: text and markdown tables, JSON/CSV rows, PNG figures titled with device and date.

The convention every reproduction script follows (tests/test_repro_convention.py checks each one):
- options from `script_parser` / `add_output_args`: `--out` defaults to a path under runs/ (a
  committed result is only overwritten when --out names it), `--from-json` re-renders a saved result
  without measuring, and every option's help states its default (`help_with_defaults`);
- `publish(out, ...)` prints a header (title, device from the run's meta, date), the table and the
  paper verdicts (bench.paper, one format), then writes `<out>.json` ({"written_by", "meta", "rows",
  "paper"}), `<out stem>.md` and `<out stem>.png` (the script's figure, or ours-vs-paper bars when it has
  none), atomically and marked as REPORT's (cli_checks.Writer: --out replaces only such files), and prints
  the paths it wrote. Figures are titled with the machine and the date of the
  measurement (from `meta`, so a re-render of an old result keeps the date it was measured).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from nanotron_ext.bench.paper import Verdict, verdict_table
from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import InputFile, OutputStem, Parser
from nanotron_ext.fileio import write_text_atomic

# every result published here (reproduction scripts, benchmarks, the meter) carries this marker; results written
# before markers: {"meta", "rows", ...}, or a het_sparseloco sweep's partial {"meta", "summary", "runs"}
REPORT = Writer("nanotron_ext.bench.report", "a reproduction script", ("rows", "meta"),
                legacy_shape=lambda obj: {"meta", "summary", "runs"} <= set(obj))


# ------------------------------------------------------------------------------------------------
# what the numbers were measured on
# ------------------------------------------------------------------------------------------------
def machine_label() -> str:
    """'8x NVIDIA H100 ...' on GPUs, 'CPU (x86_64, 2 cores)' otherwise: for titles and JSON meta."""
    try:
        # an orchestrator may run without torch
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - a label must never fail a run
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def default_backend() -> str:
    """The process-group backend a run on this machine uses ("nccl" with CUDA, "gloo" otherwise)."""
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except Exception:  # noqa: BLE001 - a label must never fail a run
        return "gloo"


def code_version() -> Optional[str]:
    """The commit the package ran from, '+modified' when nanotron_ext/ differs from it (result files being
    written elsewhere in the tree do not count); None outside a git checkout."""
    package = Path(__file__).resolve().parents[1]
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", *argv], cwd=package, capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()

        return git("rev-parse", "--short=12", "HEAD") + ("+modified" if git("status", "--porcelain", "--", ".") else "")
    except (OSError, subprocess.SubprocessError):  # a label must never fail a run
        return None


def run_meta(extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Date, host, machine label, backend, the code's commit and the 1-minute load average (a shared
    machine's load explains noise)."""
    meta: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": machine_label(),
        "backend": default_backend(),
        "commit": code_version(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    meta.update(extra or {})
    return meta


def device_label(meta: Mapping[str, Any]) -> str:
    """'CPU (x86_64, 2 cores), gloo' from a result's meta (what it ran on, not what re-renders it)."""
    machine = meta.get("machine") or meta.get("device") or "device not recorded"
    backend = meta.get("backend")
    return f"{machine}, {backend}" if backend and backend not in str(machine) else str(machine)


# ------------------------------------------------------------------------------------------------
# the command line every reproduction script shares
# ------------------------------------------------------------------------------------------------
def help_with_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every visible option's help ends with its default (argparse fills %(default)s)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public iterator over its actions
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        action.help = action.help or action.dest.replace("_", " ")
        if "%(default)" not in action.help and "default" not in action.help:
            action.help += " (default: %(default)s)"
    return parser


# --out of every script, checked when the arguments are parsed, before anything is measured (a bad --out used to
# surface only when the result was written, after hours): <out>.json (or the .csv), <out>.md and <out>.png by the
# rule of every written file (cli_checks.Writer): each may replace only a file REPORT wrote, never a run's
# summary.json; none may be a folder or a device, and --out itself not a device (/dev/null)
checked_out = OutputStem(REPORT)
checked_out_path = OutputStem(REPORT, as_path=True)  # for a script that reads --out as a Path
SAVED_RESULT = InputFile(format="json")  # --from-json: a result a script wrote (read_saved checks its content)


def add_output_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """--out (under runs/ by default; checked at parse time) and --from-json."""
    parser.add_argument("--out", default=default_out, type=checked_out,
                        help="the result's JSON; the markdown and PNG are written beside it (default: %(default)s; "
                             "the committed result under reproduce/ is only rewritten when --out names it)")
    parser.add_argument("--from-json", metavar="JSON", type=SAVED_RESULT,
                        help="measure nothing: re-render a result this script wrote (its JSON) to --out")


def script_parser(description: Optional[str], default_out: str) -> argparse.ArgumentParser:
    """The parser of a reproduction script: its docstring as help text, --out and --from-json."""
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p, default_out)
    return p


def read_saved(path: str | Path, flag: str = "--from-json") -> Dict[str, Any]:
    """A result a script wrote (--from-json, or `flag`, e.g. --merge): a JSON object with its rows (a list) or its
    meta (an object); when it is not one, an ArgumentError naming the flag and the file, which every script's main
    turns into its one line and exit code 2 (cli_flags.one_line_refusals)."""
    from nanotron_ext.cli_checks import JsonFile
    from nanotron_ext.plan.cached import first_non_finite

    saved = JsonFile(Path(path), flag)
    data = saved.read_object()
    if not {"rows", "meta", "utilisation_model"} & set(data):
        saved.fail("holds an object without rows or meta: not a result a reproduction script wrote")
    saved.need(data, "rows", list, optional=True)  # {"rows": NaN} was a traceback while re-rendering
    saved.need(data, "meta", dict, optional=True)
    bad = first_non_finite(data.get("rows"), "rows")  # (a NaN in a row was a table of nan, exit 0)
    if bad:
        saved.fail(f"{bad}, not a finite number")
    return data


def print_header(title: str, meta: Mapping[str, Any], *details: str) -> None:
    """The lines printed before a script's rows: what, on which device, when."""
    print(f"{title}\n{device_label(meta)}, {str(meta.get('date', '?'))[:19]}" + "".join(f"\n{d}" for d in details))


def publish(out: str | Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], title: str,
            headers: Sequence[Any], body: Sequence[Sequence[Any]], verdicts: Sequence[Verdict] = (),
            figure: Any = None, notes: Sequence[str] = (),
            extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Path]:
    """Print header, table and verdicts; write JSON + markdown + PNG (see the module docstring); print
    the paths written."""
    print_header(title, meta)
    print(format_table(headers, body))
    if verdicts:
        print("\npaper vs ours:")
        for v in verdicts:
            print("  " + v.line())
    for n in notes:
        print(n)
    return write_report(out, rows, meta, title, headers, body, verdicts, figure, notes, extra)


def publish_rendered(out: str | Path, saved: Mapping[str, Any], title: str,
                     rendered: Mapping[str, Any]) -> Dict[str, Path]:
    """`publish` of a script's saved result (`rows`, `meta`) and its render() output (`headers`, `body`,
    `verdicts`, `figure`, `notes`, `extra`)."""
    r = rendered
    return publish(out, saved["rows"], saved["meta"], title, r["headers"], r["body"], r["verdicts"], r["figure"],
                   r["notes"], r["extra"])


# ------------------------------------------------------------------------------------------------
# cells and tables
# ------------------------------------------------------------------------------------------------
def fmt_bytes(n: Optional[float], unit: str = "KiB") -> str:
    if n is None:
        return "-"
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    return f"{n / scale:,.1f}"


def fmt_time_ms(summary: Any) -> str:
    """'mean +- std' of a Summary in ms."""
    if summary is None:
        return "-"
    return f"{summary.mean * 1e3:,.1f} +- {summary.std * 1e3:,.1f}"


def fmt_ratio(value: Optional[Sequence[float]]) -> str:
    """'1.23x +- 0.04' of (ratio, standard error)."""
    if value is None:
        return "-"
    return f"{value[0]:.2f}x +- {value[1]:.2f}"


def fmt_x(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _cells(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> List[List[str]]:
    return [[str(h) for h in headers]] + [[("-" if c is None else str(c)) for c in row] for row in rows]


def format_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (left-aligned first column)."""
    cells = _cells(headers, rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def markdown_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (pipes in cells escaped)."""
    cells = [[c.replace("|", "\\|") for c in r] for r in _cells(headers, rows)]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(headers)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in cells[1:]])


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------
def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]], meta: Optional[Mapping[str, Any]] = None,
               extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Rows as JSON ({"written_by", "meta", "rows", **extra}) or, for a .csv path, CSV (flat columns only; nested
    values JSON-encoded); written atomically."""
    path = Path(path)
    if path.suffix.lower() != ".csv":
        return REPORT.write_json(path, {"meta": dict(meta or {}), "rows": list(rows), **dict(extra or {})},
                                 default=_json_default)
    keys: List[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    for row in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
    write_text_atomic(path, f.getvalue())
    return path


def figure_title(what: str, meta: Mapping[str, Any]) -> str:
    """Every figure says what produced it: device and date."""
    return f"{what}\n{meta.get('machine', machine_label())}, {str(meta.get('date', ''))[:10]}"


def markdown_report(title: str, meta: Mapping[str, Any], headers: Sequence[Any], body: Sequence[Sequence[Any]],
                    verdicts: Sequence[Verdict] = (), notes: Sequence[str] = ()) -> str:
    """The markdown page of one result: title, machine and date, table, paper vs measured."""
    parts = [f"# {title}", "", f"{device_label(meta)}, {meta.get('date', '?')}"
             + (f", tp={meta['tp']}" if "tp" in meta else ""), "", markdown_table(headers, body)]
    if verdicts:
        parts += ["", "## Paper vs measured", "", markdown_table(*verdict_table(verdicts))]
    parts += [""] + [n for n in notes] if notes else []
    return "\n".join(parts) + "\n"


def write_report(out: str | Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], title: str,
                 headers: Sequence[Any], body: Sequence[Sequence[Any]], verdicts: Sequence[Verdict] = (),
                 figure: Any = None, notes: Sequence[str] = (),
                 extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Path]:
    """Write the JSON (or CSV; `extra`: more top-level JSON keys), the markdown beside it and the PNG
    beside it (titled `title` + machine + date): `figure`, or ours-vs-paper bars of the verdicts (the
    table itself when no verdict has a paper number). Prints and returns {"json"|"csv", "md", "png"}."""
    out = Path(out)
    if out.suffix.lower() not in (".json", ".csv"):
        out = out.with_suffix(".json")
    written: Dict[str, Path] = {}
    key = "csv" if out.suffix.lower() == ".csv" else "json"
    written[key] = write_rows(out, rows, meta, {**dict(extra or {}), "paper": [v.as_dict() for v in verdicts]}
                              if key == "json" else None)
    md = markdown_report(title, meta, headers, body, verdicts, notes)
    written["md"] = REPORT.write_markdown(out.with_suffix(".md"), md)
    if figure is None:
        figure = verdict_figure(verdicts) or table_figure(headers, body)
    written["png"] = save_figure(figure, out.with_suffix(".png"), title, meta)
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return written


def verdict_figure(verdicts: Sequence[Verdict]) -> Any:
    """Ours / paper per claim with a paper number (1 = the paper's value), coloured by verdict; None
    when no claim has both numbers."""
    shown = [v for v in verdicts if v.ours_over_paper is not None]
    if not shown:
        return None
    colours = {"held": "tab:green", "NOT held": "tab:red", "held in direction only": "tab:orange"}
    fig, ax = new_figure(1, width=9.0, height=0.4 * len(shown) + 1.8)
    labels = [f"{v.claim.source}: {v.claim.name}"[:70] for v in shown]
    ax.barh(labels, [v.ours_over_paper for v in shown], color=[colours.get(v.status, "tab:gray") for v in shown])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("ours / paper\ngreen held, red NOT held, orange direction only, grey undetermined or value only")
    return fig


def table_figure(headers: Sequence[Any], body: Sequence[Sequence[Any]]) -> Any:
    """The table as a picture (results without a paper number to plot against)."""
    fig, ax = new_figure(1, width=min(16.0, 1.4 * len(headers) + 2), height=0.3 * len(body) + 1.2)
    ax.axis("off")
    cells = _cells(headers, body)
    table = ax.table(cellText=cells[1:] or [["-"] * len(headers)], colLabels=cells[0], loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    return fig


def save_figure(fig: Any, png: str | Path, title: str, meta: Mapping[str, Any], writer: Writer = REPORT) -> Path:
    """Title the figure with what it shows, the machine and the date, and save it as PNG (`writer`'s marker,
    atomically)."""
    fig.suptitle(figure_title(title, meta), fontsize=10)
    fig.tight_layout()
    writer.save_png(fig, png, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Path(png)


def new_figure(ncols: int, width: float = 5.0, height: float = 4.5) -> Any:
    """(figure, axes) of one row of panels, with the non-interactive Agg backend."""
    # matplotlib only when plotting (seconds to import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height))


def grouped_bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[Optional[float]]],
                 errors: Optional[Mapping[str, Sequence[Optional[float]]]] = None, ylabel: str = "",
                 color: Optional[Callable[[str], Optional[str]]] = None) -> None:
    """Side-by-side bars: one cluster per group, one bar per series (None = not measured);
    `color(label)` picks a series' colour (one colour per compared design across figures)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        vals = [float("nan") if v is None else v for v in values]
        err = None
        if errors and label in errors:
            err = [0.0 if e is None else e for e in errors[label]]
        ax.bar(xs, vals, width, yerr=err, label=label, capsize=2, color=color(label) if color else None)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
