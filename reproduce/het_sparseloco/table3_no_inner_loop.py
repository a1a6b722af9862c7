"""Table 3 at CPU scale: the same pipeline compression without SparseLoCo's inner loop (AdamW, gradients
averaged over the M replicas every step), uniform and heterogeneous (1/2) at d/k = 8; and Table 3(a): the
compressed SparseLoCo rows with 20% more tokens (steps) than the SparseLoCo baseline of Table 1.
Simulated replicas (reproduce/het_sparseloco/common.py). The paper's AdamW rows use lr 3e-4 against
SparseLoCo's inner 1e-3; here every row keeps the config's learning rate.

    python reproduce/het_sparseloco/table3_no_inner_loop.py --out reproduce/het_sparseloco/results/table3_cpu
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from nanotron_ext.cli_flags import one_line_refusals
from nanotron_ext.config.loader import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_overrides, parse, parser, print_deltas, replicas, run_table  # noqa: E402

# Paper Table 3 (512M) and 3(a) (token budget 10B -> 12B); SparseLoCo baseline 2.73 (Table 1)
PAPER = {"AdamW": 2.75, "AdamW + PP-Compression": 2.81, "AdamW + Het PP-Compression (1/2)": 2.83,
         "SparseLoCo": 2.73, "SparseLoCo + PP-Compress, +20% tokens": 2.78,
         "SparseLoCo + Het-PP-Compress (1/2), +20% tokens": 2.75}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(parser(__doc__, "table3"), argv)
    steps = load_config(args.config_file, base_overrides(args)).tokens.train_steps
    more = [f"tokens.train_steps={round(steps * 1.2)}"]
    rows = {"AdamW": ("dense", [replicas(0)]),
            "AdamW + PP-Compression": ("dense", [replicas(args.replicas)]),
            "AdamW + Het PP-Compression (1/2)": ("dense", [replicas(args.compressed)]),
            "SparseLoCo": ("sparseloco", [replicas(0)]),
            "SparseLoCo + PP-Compress, +20% tokens": ("sparseloco", [replicas(args.replicas)] + more),
            "SparseLoCo + Het-PP-Compress (1/2), +20% tokens": ("sparseloco", [replicas(args.compressed)] + more)}
    run_table(args, rows, PAPER, "Heterogeneous SparseLoCo, Table 3 (no inner loop) and 3(a) (+20% tokens)")
    print_deltas(args, [("AdamW + PP-Compression", "AdamW", ">"),
                        ("AdamW + Het PP-Compression (1/2)", "AdamW + PP-Compression", ">"),
                        ("SparseLoCo + Het-PP-Compress (1/2), +20% tokens",
                         "SparseLoCo + PP-Compress, +20% tokens", "<"),
                        ("SparseLoCo + PP-Compress, +20% tokens", "SparseLoCo", ">"),
                        ("SparseLoCo + Het-PP-Compress (1/2), +20% tokens", "SparseLoCo", ">")],
                 PAPER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
