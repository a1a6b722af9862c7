"""Tokens/s of the tiny default config on this machine, for several parallel layouts.

    python benchmarks/tiny_tokens_per_s.py [--steps 30] [--layouts dp2,tp2,pp2] [--out result.json]

Each layout runs `torchrun --nproc_per_node 2 -m nanotron_ext.train` on examples/config_tiny_llama.yaml
(data must be prepared: `make train-tiny` or `python -m nanotron_ext.data prepare --config-file ...`)
and reads the run's summary.json (tokens/s averaged over steps after the first). Prints one table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from nanotron_ext.cli_flags import one_line_refusals

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}


def run_layout(name: str, steps: int, config: Path, work: Path) -> Dict[str, object]:
    dp, tp, pp = LAYOUTS[name]
    sets = [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"tokens.train_steps={steps}",
            "tokens.val_check_interval=0", "tokens.val_steps=1", "checkpoints.resume=never",
            "logging.progress_bar=false",
            f"general.output_dir={work}", f"general.run={name}", f"checkpoints.dir={work / name / 'ckpt'}"]
    if pp > 1:
        sets.append("model.tie_embeddings=false")  # tying needs both ends on one stage
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(dp * tp * pp),
           "-m", "nanotron_ext.train", "--config-file", str(config)] + [a for s in sets for a in ("--set", s)]
    log = work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"layout {name} failed (exit {proc.returncode}); last lines of its log:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    summary = json.loads((work / name / "summary.json").read_text())
    return {**summary, "layout": name}  # the row's name, not the summary's {dp, tp, pp} dict


@one_line_refusals
def main(argv: List[str] | None = None) -> int:
    from nanotron_ext.bench.report import REPORT
    from nanotron_ext.cli_flags import InputFile, Int, Names, OutputFile, Parser

    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=Int(1), default=30)
    parser.add_argument("--layouts", default="dp2,tp2,pp2", type=Names(tuple(LAYOUTS)))  # (a typo: a KeyError
    # traceback after the layouts before it had trained)
    parser.add_argument("--config-file", type=InputFile(format="yaml", as_path=True),
                        default=str(REPO / "examples" / "config_tiny_llama.yaml"))
    # --out is checked before any layout runs (the rule of cli_checks.Writer)
    parser.add_argument("--out", type=OutputFile(REPORT, as_path=True),
                        help="also write the rows as JSON (replaces only a result it wrote)")
    args = parser.parse_args(argv)
    from nanotron_ext.config.loader import load_config

    load_config(args.config_file)  # before the first layout starts (a damaged config: one line)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            rows.append(run_layout(name, args.steps, args.config_file, Path(tmp)))
    print(f"tiny config, {args.steps} steps, {platform.processor() or platform.machine()}, "
          f"{datetime.date.today().isoformat()}")
    print(f"{'layout':<8}{'tokens/s':>10}{'final loss':>12}  bytes sent per step (all ranks)")
    for r in rows:
        comm = ", ".join(f"{g} {b / 2**20:.2f} MiB" for g, b in sorted(r["comm_bytes_per_step"].items()))
        print(f"{r['layout']:<8}{r['tokens_per_s']:>10.0f}{r['final_train_loss']:>12.4f}  {comm}")
    if args.out:  # {"written_by", "meta", "rows"}, atomically
        from nanotron_ext.bench.report import run_meta, write_rows

        write_rows(args.out, rows, run_meta({"steps": args.steps, "config": str(args.config_file)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
