"""Parameter counts of the ResBM 2B configs, built on the meta device (no memory, exact shapes):

    python reproduce/resbm/param_counts.py            # table: ours beside the paper's (appendix A.3)
    python reproduce/resbm/param_counts.py --json out.json   # also as JSON ({"written_by", config: counts})

The paper ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism", arXiv:2604.11947,
appendix A.3) gives 1,896,751,104 for the baseline and 1,960,157,184 for the 128x model. Ours: the
baseline matches exactly; our 128x model has 7 (encoder, decoder) pairs of d<->m<->h halves with
m = 1024, 14 x 1024 x (4096 + 32) = 59,179,008 extra parameters. The paper's +63,406,080 is
15 x 1024 x (4096 + 32): one more half than 7 pairs have (63,406,080 / 7 is not an integer), e.g. an
encoder on the last block too or a decoder on the first; the paper's text (block 8 has no encoder,
block 1 no decoder) does not say which, so we build what the text describes and report the gap.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import OutputFile, Parser, one_line_refusals
from nanotron_ext.models.param_count import count_config_file, count_params  # noqa: F401 - tests load count_params

HERE = Path(__file__).resolve().parent
# --json replaces only counts this script wrote (cli_checks.Writer); results/param_counts.json has one key per config
COUNTS = Writer("reproduce/resbm/param_counts.py", legacy_keys=("baseline",))
PAPER = {"baseline": 1_896_751_104, "128x_muon": 1_960_157_184, "128x_adamw": 1_960_157_184}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, int]]:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, type=OutputFile(COUNTS), help="also write the counts to this JSON file")
    args = ap.parse_args(argv)
    rows: Dict[str, Dict[str, int]] = {}
    for path in sorted(HERE.glob("resbm_2b_*.yaml")):
        name = path.stem.replace("resbm_2b_", "")
        ours = count_config_file(path)
        rows[name] = {"ours": ours, "paper": PAPER.get(name)}
    base = rows["baseline"]["ours"]
    print(f"{'config':<12} {'ours':>15} {'paper':>15} {'ours - baseline':>16}")
    for name, r in rows.items():
        paper = f"{r['paper']:,}" if r["paper"] else "-"
        print(f"{name:<12} {r['ours']:>15,} {paper:>15} {r['ours'] - base:>16,}")
    print("paper 128x - baseline = 63,406,080 = 15 x 1024 x (4096 + 32); ours has 14 such halves (7 pairs)")
    if args.json:
        COUNTS.write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
