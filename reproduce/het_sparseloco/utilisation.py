"""Compute utilisation over inter-replica bandwidth from a measured run (the SparseLoCo-vs-dense part of
figs. 2 and 3b of "Heterogeneous Low-Bandwidth Pre-Training of LLMs").

    python reproduce/het_sparseloco/utilisation.py --sparseloco runs/tiny_sparseloco --dense runs/tiny_dense \
        [--json out.json]

Reads each run's metrics.jsonl: the inner step time (median over steps that are not outer syncs, first
step dropped), the ledger's DP bytes per sync step (SparseLoCo: payload per replica = the extra DP bytes
of a sync step over an inner step, divided by dp) and per step (dense: gradient all-reduce bytes per
replica), then evaluates nanotron_ext.sparseloco.accounting's time model at each bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

from nanotron_ext.sparseloco.accounting import compute_utilisation

BANDWIDTHS = [1e6, 1e7, 1e8, 1e9, 1e10]  # bit/s


def measured(run_dir: Path) -> Dict[str, float]:
    """Inner step time, DP bytes per replica of a sync step and of an inner step, dp, H."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    dp = cfg["parallelism"]["dp"]
    h = cfg.get("sparseloco", {}).get("inner_steps", 1) if cfg["parallelism"].get("dp_sync") == "sparseloco" else 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    inner = [r for r in rows if h == 1 or r["step"] % h]
    sync = [r for r in rows if h == 1 or r["step"] % h == 0]
    inner_bytes = statistics.median(r["comm_bytes"].get("dp", 0) for r in inner) / dp
    sync_bytes = statistics.median(r["comm_bytes"].get("dp", 0) for r in sync) / dp
    return {"step_time_s": statistics.median(r["step_time_s"] for r in inner), "dp": dp, "inner_steps": h,
            "sync_bytes": sync_bytes - (inner_bytes if h > 1 else 0), "inner_bytes": inner_bytes}


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sparseloco", type=Path, required=True)
    p.add_argument("--dense", type=Path, required=True)
    p.add_argument("--replicas", type=int, default=None, help="M for the model (default: the runs' dp)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sl, dn = measured(args.sparseloco), measured(args.dense)
    m = args.replicas or int(sl["dp"])
    rows = []
    for b in BANDWIDTHS:
        rows.append({"bandwidth_bps": b,
                     "sparseloco": compute_utilisation(sl["step_time_s"], int(sl["inner_steps"]), sl["sync_bytes"], m, b, "all_gather"),
                     "dense_dp": compute_utilisation(dn["step_time_s"], 1, dn["sync_bytes"], m, b, "all_reduce")})
    print(f"measured: sparseloco {sl}\n          dense      {dn}\nM = {m}")
    print(f"{'bandwidth':>12}  {'SparseLoCo':>10}  {'dense DP':>10}")
    for r in rows:
        print(f"{r['bandwidth_bps'] / 1e6:>8g} Mb/s  {r['sparseloco']:>10.4f}  {r['dense_dp']:>10.4f}")
    if args.json:
        args.json.write_text(json.dumps({"measured": {"sparseloco": sl, "dense": dn}, "replicas": m, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
