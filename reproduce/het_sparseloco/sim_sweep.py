"""CPU-scale sweeps with simulated replicas: M data-parallel replicas of a config trained one after another
in one process (nanotron_ext.sparseloco.simulate.run_simulated, equal to the trainer bit for bit).

    python reproduce/het_sparseloco/sim_sweep.py --config-file examples/config_tiny_sparseloco.yaml \
        --replicas 4 --set tokens.train_steps=100 \
        --variant dense --variant topk=32 --variant topk=4096,value_dtype=fp32 --out runs/het_sparseloco/cpu_sweep

A variant is "dense" (gradients averaged every step: the paper's AdamW rows) or comma-separated
`sparseloco.*` overrides. Writes <out>.json (per-step mean train loss, final validation loss, bytes per
replica per sync), <out>.md and <out>.png (train loss curves); the committed sweeps are
reproduce/het_sparseloco/results/cpu_sweep_m4{,_senders}.{json,md,png}. No paper number sits beside these sweeps (a
harness check: SparseLoCo variants against dense replicas); `--from-json` re-renders one.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, List

from nanotron_ext.bench import report as br
from nanotron_ext.cli_flags import one_line_refusals
from nanotron_ext.config.loader import load_config
from nanotron_ext.sparseloco.simulate import run_simulated


def measure(args: Any) -> Dict[str, Any]:
    if not args.variant:
        from nanotron_ext.cli_checks import refuse  # (was exit code 1)

        refuse("--variant: give at least one (dense, or comma-separated sparseloco.* overrides)")
    results = {}
    for variant in args.variant:
        extra = [] if variant == "dense" else [f"sparseloco.{kv}" for kv in variant.split(",") if kv]
        cfg = load_config(args.config_file, args.overrides + extra)
        t0 = time.perf_counter()
        out = run_simulated(cfg, args.replicas, "dense" if variant == "dense" else "sparseloco", args.config_file)
        out.pop("weights")
        out.pop("models", None)  # modules are not JSON
        out["wall_s"] = time.perf_counter() - t0
        results[variant] = out
    meta = br.run_meta({"config_file": args.config_file, "overrides": args.overrides, "replicas": args.replicas})
    return {"meta": meta, "results": results}


@one_line_refusals
def main(argv: List[str] | None = None) -> int:
    p = br.script_parser(__doc__, "runs/het_sparseloco/sweep.json")
    from nanotron_ext.cli_flags import CONFIG, Int, KeyValue, Text

    p.add_argument("--config-file", default="examples/config_tiny_sparseloco.yaml", type=CONFIG,
                   help="the base config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config overrides")
    p.add_argument("--replicas", type=Int(1), default=4, help="M simulated replicas")
    p.add_argument("--variant", action="append", default=[], type=Text(),
                   help="dense, or comma-separated sparseloco.* overrides")
    args = br.help_with_defaults(p).parse_args(argv)
    saved = br.read_saved(args.from_json) if args.from_json else measure(args)
    results, meta = saved["results"], saved["meta"]
    rows = [{"variant": v, "final_train_loss": o["train_loss"][-1], "val_loss": o["val_loss"],
             "bytes_per_sync_per_replica": (o["sync_bytes"] or [None])[0], "wall_s": o.get("wall_s")}
            for v, o in results.items()]
    headers = ["variant", "final train loss", "val loss", "bytes / sync / replica"]
    body = [[r["variant"], f"{r['final_train_loss']:.4f}", f"{r['val_loss']:.4f}", r["bytes_per_sync_per_replica"]]
            for r in rows]
    fig, ax = br.new_figure(1, width=6, height=4)
    for variant, out in results.items():
        ax.plot(range(1, len(out["train_loss"]) + 1), out["train_loss"], label=f"{variant} (val {out['val_loss']:.3f})")
    ax.set_xlabel("inner step")
    ax.set_ylabel(f"train loss (mean of {meta.get('replicas')} replicas)")
    ax.legend(fontsize=7)
    br.publish(args.out, rows, {"machine": "not recorded (before the shared convention)", **meta},
               f"SparseLoCo simulated sweep, M = {meta.get('replicas')}", headers, body, figure=fig,
               extra={"results": results}, notes=["no paper number: a harness sweep"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
