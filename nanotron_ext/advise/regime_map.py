"""`python -m nanotron_ext.advise.regime_map --out reproduce/wan/results/regime_map`: the regime map (regime.py) from
our loss runs' penalties and, beside it, from the papers' published penalties; JSON, markdown and one PNG (a heat map
per model size and source: the winner per internet link and datacenter share, its margin written in the cell)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.advise.layouts import COMPOSED, RULES
from nanotron_ext.advise.penalties import sources
from nanotron_ext.advise.regime import LINKS_MBPS, SHARES, SIZES, Cell, regime
from nanotron_ext.cli_flags import OutputFolder, OutputStem, Parser, one_line_refusals

SHORT = {"dense_3d": "dense", "dense_3d@bf16": "dense bf16", "3d_diloco": "DiLoCo avg",
         "3d_diloco_nesterov": "DiLoCo Nesterov", "3d_sparseloco": "SparseLoCo", "3d_btp": "BTP", "3d_sm": "SM",
         "3d_sm_sparseloco": "het. SparseLoCo", "3d_btp_sparseloco": "BTP+SparseLoCo", "three_tiers": "three tiers",
         "3d_diloco_nesterov_streaming": "DiLoCo Nest. stream", "3d_btp_sparseloco_streaming": "BTP+SpLoCo stream",
         "three_tiers_streaming": "three tiers stream"}


def table(cells: Sequence[Cell], source: str) -> List[str]:
    """One markdown row per cell."""
    out = [f"| size | internet | datacenter | winner ({source}) | h | runner-up | h | margin |",
           "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        w, r = c.winner, c.runner_up

        def name(x: Any) -> str:
            if x is None:
                return "-"
            lay = x.priced.layout
            return f"{SHORT.get(x.name, x.name)}: {lay.dp}x{lay.tp}x{lay.pp}"

        hours = lambda x: f"{x.time_s / 3600:.2f}" if x else "-"  # noqa: E731
        margin = f"{c.margin:.2f}x" if c.margin else "-"
        bold = "**" if w is not None and w.name in COMPOSED else ""
        open_ = f" (not resolved: {', '.join(SHORT.get(u, u) for u in c.unresolved)} might win)" if c.unresolved else ""
        out.append(f"| {c.size} | {c.mbps:g} Mbit/s | {c.share:.0%} | {bold}{name(w)}{bold}{open_} | {hours(w)} | "
                   f"{name(r)} | {hours(r)} | {margin} |")
    return out


def figure(maps: Dict[str, List[Cell]], path: Path, title: str, marker: str) -> None:
    """A heat map per (source, size): x the internet link, y the datacenter share, colour the winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({c.winner.name for cells in maps.values() for c in cells if c.winner}, key=list(RULES).index)
    colour = {s: i for i, s in enumerate(systems)}
    fig, axes = plt.subplots(len(maps), len(SIZES), figsize=(5 * len(SIZES), 2.6 * len(maps)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for row, (source, cells) in enumerate(maps.items()):
        for col, size in enumerate(SIZES):
            ax = axes[row][col]
            grid = [[float("nan")] * len(LINKS_MBPS) for _ in SHARES]
            for c in cells:
                if c.size != size or c.winner is None:
                    continue
                i, j = SHARES.index(c.share), LINKS_MBPS.index(c.mbps)
                grid[i][j] = colour[c.winner.name]
                ax.text(j, i, f"{SHORT.get(c.winner.name, c.winner.name)}\n{c.margin or 0:.2f}x", ha="center",
                        va="center", fontsize=6)
            ax.imshow(grid, cmap=cmap, vmin=0, vmax=9, aspect="auto", origin="lower")
            ax.set_xticks(range(len(LINKS_MBPS)), [f"{m / 1000:g}G" if m >= 1000 else f"{m}M" for m in LINKS_MBPS],
                          fontsize=7)
            ax.set_yticks(range(len(SHARES)), [f"{s:.0%}" for s in SHARES], fontsize=7)
            ax.set_title(f"{size}, {source}", fontsize=9)
            ax.set_xlabel("internet link", fontsize=7)
            ax.set_ylabel("datacenter share", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata={"written_by": marker})
    plt.close(fig)


def parser() -> Parser:
    from nanotron_ext.advise.__main__ import ADVISE

    p = Parser(prog="python -m nanotron_ext.advise.regime_map", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=OutputStem(ADVISE), required=True, help="<out>.json, .md and .png")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--cache", type=OutputFolder(), default=None, help="where plans are kept (default: advise's)")
    p.add_argument("--losses", nargs="+", choices=sources(), default=["model_clock", "papers"],
                   help="one map per loss-run set")
    return p


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    import datetime
    import platform

    from nanotron_ext.advise.__main__ import ADVISE, CACHE
    from nanotron_ext.fileio import write_text_atomic

    args = parser().parse_args(argv)
    cache = Path(args.cache) if args.cache else CACHE
    used: set = set()
    names = {"model_clock": "our loss runs, d = 128", "papers": "the papers' losses"}
    maps = {names.get(src, f"our loss runs, {src}"): regime(src, cache, sizes=args.sizes, used=used)
            for src in args.losses}
    out = Path(args.out)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = f"clock replayed on {platform.machine()} CPU ({date})"
    ADVISE.write_json(out.with_suffix(".json"), {"date": date, "device": device, "plans": sorted(used),
                                                 "maps": {k: [c.as_dict() for c in v] for k, v in maps.items()}})
    lines = [ADVISE.markdown_marker, f"# The regime map ({device})", ""]
    for source, cells in maps.items():
        wins = [c for c in cells if c.winner is not None and c.winner.name in COMPOSED]
        lines += [f"## From {source}: a composed job wins {len(wins)} of {len(cells)} cells", "",
                  *table(cells, source), ""]
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    figure(maps, out.with_suffix(".png"), f"Winner at its best layout per cell and its margin ({date})",
           ADVISE.marker)
    print("\n".join(lines[2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
