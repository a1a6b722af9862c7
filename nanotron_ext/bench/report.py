"""Reports: text and markdown tables, JSON/CSV rows, PNG figures titled with device and date.

`write_report(out, ...)` is what a script calls at the end: `<out>.json` ({"meta", "rows", "paper"}),
`<out stem>.md` (the table and the paper-vs-measured verdicts) and, given a figure, `<out stem>.png`
whose title names the machine and the date of the measurement (from `meta`, so a re-render of an
old result keeps the date it was measured).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from nanotron_ext.bench.paper import Verdict, verdict_table


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


def run_meta(extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Date, host, machine label and 1-minute load average (a shared machine's load explains noise)."""
    meta: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": machine_label(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    meta.update(extra or {})
    return meta


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


def _atomic_write(path: Path, write: Callable[[Any], None]) -> Path:
    """Write through a temporary file in the same folder, then rename (no half-written result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as f:
        write(f)
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are for everyone to read
    os.replace(tmp, path)
    return path


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]], meta: Optional[Mapping[str, Any]] = None,
               extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Rows as JSON ({"meta", "rows", **extra}) or, for a .csv path, CSV (flat columns only; nested
    values JSON-encoded)."""
    path = Path(path)

    def write(f: Any) -> None:
        if path.suffix.lower() == ".csv":
            keys: List[str] = []
            for row in rows:
                keys += [k for k in row if k not in keys]
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for row in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
        else:
            json.dump({"meta": dict(meta or {}), "rows": list(rows), **dict(extra or {})}, f, indent=2,
                      default=_json_default)
            f.write("\n")

    return _atomic_write(path, write)


def figure_title(what: str, meta: Mapping[str, Any]) -> str:
    """Every figure says what produced it: device and date."""
    return f"{what}\n{meta.get('machine', machine_label())}, {str(meta.get('date', ''))[:10]}"


def markdown_report(title: str, meta: Mapping[str, Any], headers: Sequence[Any], body: Sequence[Sequence[Any]],
                    verdicts: Sequence[Verdict] = (), notes: Sequence[str] = ()) -> str:
    """The markdown page of one result: title, machine and date, table, paper vs measured."""
    parts = [f"# {title}", "", f"{meta.get('machine', '?')}, {meta.get('date', '?')}"
             + (f", tp={meta['tp']}" if "tp" in meta else ""), "", markdown_table(headers, body)]
    if verdicts:
        parts += ["", "## Paper vs measured", "", markdown_table(*verdict_table(verdicts))]
    parts += [""] + [n for n in notes] if notes else []
    return "\n".join(parts) + "\n"


def write_report(out: str | Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], title: str,
                 headers: Sequence[Any], body: Sequence[Sequence[Any]], verdicts: Sequence[Verdict] = (),
                 figure: Any = None, notes: Sequence[str] = ()) -> Dict[str, Path]:
    """Write the JSON (or CSV), the markdown beside it and, with `figure`, the PNG beside it
    (titled `title` + machine + date). Returns {"json"|"csv", "md", "png"?: path}."""
    out = Path(out)
    written: Dict[str, Path] = {}
    key = "csv" if out.suffix.lower() == ".csv" else "json"
    written[key] = write_rows(out, rows, meta, {"paper": [v.as_dict() for v in verdicts]} if key == "json" else None)
    md = markdown_report(title, meta, headers, body, verdicts, notes)
    written["md"] = _atomic_write(out.with_suffix(".md"), lambda f: f.write(md))
    if figure is not None:
        written["png"] = save_figure(figure, out.with_suffix(".png"), title, meta)
    return written


def save_figure(fig: Any, png: str | Path, title: str, meta: Mapping[str, Any]) -> Path:
    """Title the figure with what it shows, the machine and the date, and save it as PNG."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle(figure_title(title, meta), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    os.chmod(png, 0o644)
    return png


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
