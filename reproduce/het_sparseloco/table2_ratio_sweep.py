"""Table 2 at CPU scale: uniform vs heterogeneous pipeline compression over the compression ratio d/k, with
M simulated SparseLoCo replicas in one process (reproduce/het_sparseloco/common.py: CPU_SCALE, seeds).

    python reproduce/het_sparseloco/table2_ratio_sweep.py --ratios 8 32 128 \
        --out reproduce/het_sparseloco/results/table2_cpu

Rows: SparseLoCo (no replica compressed), then per ratio r (k = d / r) "uniform" (all M replicas compressed)
and "het" (the first --compressed replicas compressed, the rest not). The 1/8 rows are Table 1's PP-Compress
rows (reused from results/table1_cpu.json when present). Writes <out>.json (per seed: per-step train loss, final
validation loss; per row: mean, std; orderings) and <out>.png (validation loss vs ratio, ours and the paper's).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_overrides, new_figure, parse, parser, print_deltas, replicas, run_table, save_plot  # noqa: E402

from nanotron_ext.cli_flags import Int, one_line_refusals  # noqa: E402
from nanotron_ext.config.loader import load_config  # noqa: E402

# Paper Table 2 (512M, DCLM): ratio -> (uniform loss, heterogeneous loss); SparseLoCo baseline 2.73
PAPER_RATIOS = {8: (2.84, 2.82), 24: (2.89, 2.88), 96: (2.96, 2.94), 192: (3.03, 2.97), 384: (3.04, 2.99),
                768: (3.07, 3.00)}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "table2")
    p.add_argument("--ratios", type=Int(1), nargs="+", default=[8, 32, 128], help="compression ratios d/k swept")
    args = parse(p, argv)
    d = load_config(args.config_file, base_overrides(args)).model.hidden_size
    rows = {"SparseLoCo": ("sparseloco", [replicas(0)])}
    paper = {"SparseLoCo": 2.73}
    for ratio in args.ratios:
        if d % ratio:
            from nanotron_ext.cli_checks import ArgumentError  # (was exit code 1)

            raise ArgumentError(f"--ratios: model.hidden_size {d} is not divisible by {ratio}")
        k = [] if ratio == args.ratio else [f"model.subspace.k={d // ratio}"]  # base_overrides sets d / --ratio
        for i, (name, n) in enumerate((("uniform", args.replicas), ("het", args.compressed))):
            rows[f"{name} 1/{ratio}"] = ("sparseloco", [replicas(n)] + k)
            if ratio in PAPER_RATIOS:
                paper[f"{name} 1/{ratio}"] = PAPER_RATIOS[ratio][i]
    run_table(args, rows, paper, "Heterogeneous SparseLoCo, Table 2 (compression-ratio sweep)",
              {"ratios": args.ratios, "paper_table2_512m": {str(r): v for r, v in PAPER_RATIOS.items()}})
    meta = args.saved["meta"]
    ratios = meta.get("ratios", args.ratios)
    print_deltas(args, [(f"het 1/{r}", f"uniform 1/{r}", "<") for r in ratios]
                 + [(f"uniform 1/{r}", "SparseLoCo", ">") for r in ratios], paper,
                 plot=lambda summary, png: _plot(summary, ratios, png, meta))
    return 0


def _plot(summary: Dict[str, Dict[str, object]], ratios: List[int], path: Path, meta: Dict[str, object]) -> None:
    """Validation loss vs ratio (mean +- std over seeds) beside the paper's Table 2."""
    m, c = meta["replicas"], meta["compressed_in_het"]
    fig, (ax, bx) = new_figure(2, width=5, height=4)
    for name, label in (("uniform", f"uniform ({m}/{m} compressed)"), ("het", f"heterogeneous ({c}/{m})")):
        s = [summary[f"{name} 1/{r}"] for r in ratios]
        ax.errorbar(ratios, [x["mean"] for x in s], yerr=[x["std"] or 0 for x in s], fmt="o-", capsize=3,
                    label=f"ours: {label}")
    ax.axhline(summary["SparseLoCo"]["mean"], color="k", ls="--", label="ours: SparseLoCo")
    ax.set(xscale="log", xlabel="compression d/k", ylabel="final validation loss (CPU scale, mean of seeds)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    pr = sorted(PAPER_RATIOS)
    bx.plot(pr, [PAPER_RATIOS[r][0] for r in pr], "o-", label="paper: uniform")
    bx.plot(pr, [PAPER_RATIOS[r][1] for r in pr], "o-", label="paper: heterogeneous (1/2)")
    bx.axhline(2.73, color="k", ls="--", label="paper: SparseLoCo")
    bx.set_xscale("log", base=2)
    bx.set(xlabel="compression d/k", ylabel="final loss (512M, DCLM)")
    bx.legend(fontsize=7)
    save_plot(fig, path, "Heterogeneous SparseLoCo, Table 2 (compression-ratio sweep)", meta)


if __name__ == "__main__":
    sys.exit(main())
