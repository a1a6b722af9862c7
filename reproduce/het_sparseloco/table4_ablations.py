"""Table 4 at CPU scale: the ablations of the subspace components under SparseLoCo, uniform (all M replicas
compressed) and heterogeneous (1/2), at d/k = 8: (a) embedding adaptation, (b) weight projection after every
inner step, (c) Grassmann updates of the shared U (every --grassmann-every inner steps, at outer syncs),
(d) the modified AdamW of Subspace Models. The default rows ("uniform", "het") are Table 1's PP-Compress
rows (reused from results/table1_cpu.json when present). Simulated replicas (reproduce/het_sparseloco/common.py).

    python reproduce/het_sparseloco/table4_ablations.py --out reproduce/het_sparseloco/results/table4_cpu
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse, parser, print_deltas, replicas, run_table  # noqa: E402

from nanotron_ext.cli_flags import Int, one_line_refusals  # noqa: E402

# Paper Table 4 (512M, 1/8; final training loss): the defaults are 2.84 (uniform) and 2.82 (het)
PAPER = {"uniform": 2.84, "het": 2.82, "het: no embedding adaptation": 2.89,
         "uniform: weight projection": 2.88, "het: weight projection": 2.87,
         "uniform: Grassmann": 2.84, "het: Grassmann": 2.82,
         "uniform: modified AdamW": 2.84, "het: modified AdamW": 2.82}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "table4")
    p.add_argument("--grassmann-every", type=Int(1), default=50, help="inner steps between Grassmann updates")
    args = parse(p, argv)
    switches = {"no embedding adaptation": ["sparseloco.embedding_adaptation=false"],
                "weight projection": ["sparseloco.weight_projection=true"],
                "Grassmann": [f"sparseloco.grassmann_every={args.grassmann_every}"],
                "modified AdamW": ["sparseloco.modified_adamw=true"]}
    rows = {"uniform": ("sparseloco", [replicas(args.replicas)]), "het": ("sparseloco", [replicas(args.compressed)])}
    for switch, extra in switches.items():
        for name, n in (("uniform", args.replicas), ("het", args.compressed)):
            if f"{name}: {switch}" in PAPER:  # the paper ablates adaptation in the heterogeneous setting only
                rows[f"{name}: {switch}"] = ("sparseloco", [replicas(n)] + extra)
    run_table(args, rows, PAPER, "Heterogeneous SparseLoCo, Table 4 (ablations at 87.5% compression)",
              {"grassmann_every": args.grassmann_every})
    print_deltas(args, [("het: no embedding adaptation", "het", ">"),
                        ("uniform: weight projection", "uniform", ">"), ("het: weight projection", "het", ">"),
                        ("uniform: Grassmann", "uniform", "="), ("het: Grassmann", "het", "="),
                        ("uniform: modified AdamW", "uniform", "="), ("het: modified AdamW", "het", "=")], PAPER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
