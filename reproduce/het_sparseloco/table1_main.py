"""Table 1 at CPU scale: SparseLoCo alone, with every replica's pipeline compressed (PP-Compress) and with
half of the replicas compressed (Het-PP-Compress 1/2), at the paper's 87.5% compression (d/k = 8), plus the
paper's "tuned" variants (outer lr 0.8 and a warm-up of 20% of the steps, the paper's 3910 of 19.5K).
Simulated replicas (reproduce/het_sparseloco/common.py: M = 4, H = 10, 300 inner steps, seeds 42 43 44).

    python reproduce/het_sparseloco/table1_main.py --out reproduce/het_sparseloco/results/table1_cpu
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from nanotron_ext.cli_flags import one_line_refusals
from nanotron_ext.config.loader import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_overrides, parse, parser, print_deltas, replicas, run_table  # noqa: E402

# Paper Table 1, 512M column (final training loss, DCLM); the 178M column is 3.07 / 3.14 / 3.12
PAPER = {"SparseLoCo": 2.73, "+ PP-Compress": 2.84, "+ PP-Compress (tuned)": 2.82,
         "+ Het-PP-Compress (1/2)": 2.82, "+ Het-PP-Compress (1/2) (tuned)": 2.80}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(parser(__doc__, "table1"), argv)
    steps = load_config(args.config_file, base_overrides(args)).tokens.train_steps
    tuned = ["sparseloco.outer_lr=0.8", f"optimizer.warmup_steps={steps // 5}"]
    rows = {"SparseLoCo": ("sparseloco", [replicas(0)]),
            "+ PP-Compress": ("sparseloco", [replicas(args.replicas)]),
            "+ PP-Compress (tuned)": ("sparseloco", [replicas(args.replicas)] + tuned),
            "+ Het-PP-Compress (1/2)": ("sparseloco", [replicas(args.compressed)]),
            "+ Het-PP-Compress (1/2) (tuned)": ("sparseloco", [replicas(args.compressed)] + tuned)}
    run_table(args, rows, PAPER, "Heterogeneous SparseLoCo, Table 1 (87.5% pipeline compression)")
    print_deltas(args, [("+ PP-Compress", "SparseLoCo", ">"), ("+ Het-PP-Compress (1/2)", "SparseLoCo", ">"),
                        ("+ Het-PP-Compress (1/2)", "+ PP-Compress", "<"),
                        ("+ PP-Compress (tuned)", "+ PP-Compress", "<"),
                        ("+ Het-PP-Compress (1/2) (tuned)", "+ Het-PP-Compress (1/2)", "<")], PAPER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
