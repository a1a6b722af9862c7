"""MAPL, MAPL+VQ and SSN/SM rows of the shared slow-link benchmark (nanotron_ext/bench/slow_link.py).

Issue's comparison: tokens/s and bytes per boundary of MAPL and MAPL+VQ over a slow link against the
uncompressed model over a fast one, at PP = 2 over emulated full-duplex links (the MAPL paper reports no
throughput: "end-to-end speedups on real-world low-bandwidth clusters were not provided", so there is no
paper number to set beside ours). The model is reproduce/mapl/cpu_small.yaml (d = 128, r = 32). As in
ResBM's Table 3 script, the literal 80 Mbit/s does not limit a model this small on this CPU, so the slow
link is a CPU-scale stand-in (--slow-mbps, default 1.2: the uncompressed model's link bound ~10x below
its compute rate) and the fast link is 125x faster (10 Gbit/s / 80 Mbit/s); the literal 80 Mbit/s vs 10 Gbit/s
pair is measured too. The SSN row is the Subspace Models codec at k = r (its issue's SM rows; paper Table 1:
SM over 80 Mbit/s at 592 TPS vs uncompressed over 100 Gbit/s at 603).

    .venv/bin/python reproduce/mapl/throughput.py      # writes runs/mapl/throughput.{json,md,png}
    .venv/bin/python reproduce/mapl/throughput.py --from-json reproduce/mapl/results/cpu_throughput.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.bench import slow_link  # noqa: E402
from nanotron_ext.cli_flags import Float, Int, one_line_refusals  # noqa: E402

SETTINGS = {
    "uncompressed": ["model.codec.kind=identity"],
    # SSN = the Subspace Models codec at MAPL's ratio (k = r = 32): the SM rows of the benchmark too
    "ssn_sm": ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
               "model.subspace.k=32"],
    "mapl": ["model.codec.kind=mapl"],
    # MAPL+VQ at the paper's 2x over MAPL (the main table's VQ_2X row)
    "mapl_vq": ["model.codec.kind=mapl", "model.codec.mapl.vq_groups=32", "model.codec.mapl.vq_rounds=2",
                "model.codec.mapl.vq_codebook=16"],
}


def measure(ns: argparse.Namespace) -> Dict[str, object]:
    fast = ns.slow_mbps * 125
    args = slow_link.build_parser().parse_args(
        ["--config", "reproduce/mapl/cpu_small.yaml", "--setting", "x:", "--bandwidth", "0", "--steps", str(ns.steps),
         "--budget-s", "30", "--output-dir", "runs/mapl_throughput"])
    grid = [(name, o, bw, "full") for bw in (ns.slow_mbps, 80.0) for name, o in SETTINGS.items()]
    grid += [("uncompressed", SETTINGS["uncompressed"], bw, "full") for bw in (fast, 10_000.0)]
    rows = slow_link.run_grid(args, grid)
    # each row against the uncompressed model over the link 125x faster than its own
    reference = {ns.slow_mbps: rows[-2]["tokens_per_s"], 80.0: rows[-1]["tokens_per_s"]}
    for r in rows[:-2]:
        r["relative_to_uncompressed_125x_faster"] = r["tokens_per_s"] / reference[r["bandwidth_mbps"]]
    return {"meta": br.run_meta({"slow_mbps": ns.slow_mbps, "fast_mbps": fast}), "rows": rows}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = br.script_parser(__doc__, "runs/mapl/throughput.json")
    ap.add_argument("--slow-mbps", type=Float(0.0, low_open=True), default=1.2,
                    help="the CPU-scale stand-in for 80 Mbit/s")
    ap.add_argument("--steps", type=Int(1), default=8, help="training steps per point")
    ns = br.help_with_defaults(ap).parse_args(argv)
    saved = br.read_saved(ns.from_json) if ns.from_json else measure(ns)
    rows, meta = saved["rows"], saved["meta"]
    headers, body = slow_link.table(rows)
    headers.append("/ uncompressed over a 125x faster link")
    for r, line in zip(rows, body):
        rel = r.get("relative_to_uncompressed_125x_faster")
        line.append("-" if rel is None else f"{rel:.2f}x")
    br.publish(ns.out, rows, meta,
               "MAPL / MAPL+VQ / SSN vs uncompressed: tokens/s over a slow link (PP = 2, full duplex)",
               headers, body, figure=slow_link.figure(rows),
               notes=["no paper number: the MAPL paper reports no throughput (no verdicts)"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
