"""CPU cost of every boundary codec, measured as the GPU check's codecs stage measures it (run_codec in
benchmarks/gpu_check_jobs.py, run here as that file's own `--job codecs`): encode, decode and encode+decode
forward+backward, median ns per token, and the wire's bytes per token and dtype, one boundary of
examples/config_125m_gpu.yaml (d = 768, bf16 autocast) at --micro-batch x --seq tokens (default the GPU check's
16 x 1024, ~75 s on 2 CPU cores), the same for every codec.

    python benchmarks/codec_cost.py --label after [--micro-batch 16] [--seq 1024]
        [--out runs/codec_cost/codec_cost_cpu.json]
    python benchmarks/codec_cost.py --from-json benchmarks/results/codec_cost_cpu.json

--label names the measurement: an --out that exists keeps its other labels' rows, so one file holds the cost
before and after a change, each row with its own commit and date (issue 29: lowrank's encode, MAPL-RVQ's wire).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import CODECS  # noqa: E402

from nanotron_ext.bench import launch as bl  # noqa: E402
from nanotron_ext.bench import report as br  # noqa: E402
from nanotron_ext.cli_flags import one_line_refusals  # noqa: E402

JOBS = Path(__file__).resolve().parent / "gpu_check_jobs.py"
TITLE = "Boundary codec cost (one boundary, d = 768, bf16 autocast; ns per token, median)"


def measure(label: str, micro_batch: int, seq: int, iters: int, warmup: int, threads: int) -> List[Dict[str, Any]]:
    """One torchrun job (world size 1; gloo on CPU, NCCL on a GPU) of gpu_check_jobs.py --job codecs over every
    codec."""
    work = Path(tempfile.mkdtemp(prefix="codec_cost_"))
    plan = {"items": [{"name": k, "overrides": v} for k, v in CODECS.items()],
            "config_file": str(REPO / "examples/config_125m_gpu.yaml"),
            "overrides": [f"tokens.micro_batch_size={micro_batch}", f"tokens.sequence_length={seq}",
                          f"general.backend={br.default_backend()}", "model.compile=false"],
            "iters": iters, "warmup": warmup, "deadline": time.time() + 3600}
    (work / "plan.json").write_text(json.dumps(plan))
    rc, tail = bl.launch(JOBS,
                         ["--job", "codecs", "--plan", str(work / "plan.json"), "--results", str(work / "rows.jsonl")],
                         ["--nproc_per_node", "1"], work / "log.txt", 3600, env={"OMP_NUM_THREADS": str(threads)})
    rows = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["status"] != "started"]
    if rc != 0 or any(r["status"] != "ok" for r in rows):
        raise SystemExit(f"codec job failed (rc {rc}): {bl.last_error_line(tail)}; log {work / 'log.txt'}")
    meta = br.run_meta({"threads": threads})
    return [{**r, "label": label, "shape": [micro_batch, seq, 768], "iters": iters, "warmup": warmup,
             "date": meta["date"], "commit": meta["commit"], "machine": meta["machine"], "threads": threads}
            for r in rows]


def render(saved: Dict[str, Any]) -> Dict[str, Any]:
    import matplotlib.pyplot as plt

    rows = saved["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["name"]): r for r in rows}
    names = list(dict.fromkeys(r["name"] for r in rows))
    headers = ["codec"] + [f"{what} {lab}" for lab in labels for what in ("encode", "decode", "fwd+bwd")] + \
        [f"wire B/token {lab}" for lab in labels]

    def cell(lab: str, name: str, key: str) -> Optional[str]:
        r = by.get((lab, name))
        return None if r is None else (f"{r[key]:,.0f}" if key.endswith("ns_per_token") else
                                       f"{r[key]:.0f} {r['wire_dtype']}")

    body = [[n] + [cell(lab, n, k) for lab in labels for k in
                   ("encode_ns_per_token", "decode_ns_per_token", "fwd_bwd_ns_per_token")] +
            [cell(lab, n, "wire_bytes_per_token") for lab in labels] for n in names]
    notes = ["wire B/token: the wire tensor's bytes per token as run_codec counts them (MAPL-RVQ's "
             "tensor is as wide as its backward, the quantised gradient; its forward columns are fewer: mapl/rvq.py)."]
    notes += [f"{lab}: commit {r['commit']}, {r['date'][:10]}, {r['machine']}, {r['threads']} thread(s), "
             f"{r['shape'][0]} x {r['shape'][1]} tokens, {r['iters']} iterations ({r['warmup']} warm-up)"
             for lab in labels for r in [next(x for x in rows if x["label"] == lab)]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        ax.bar([j + i * width for j in range(len(names))],
               [by[(lab, n)]["encode_ns_per_token"] if (lab, n) in by else 0 for n in names], width, label=lab)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(names))], names, rotation=30)
    ax.set_yscale("log")
    ax.set_ylabel("encode, ns per token (median)")
    ax.legend()
    ax.set_title(br.figure_title("Boundary codec encode cost", saved["meta"]), fontsize=9)
    fig.tight_layout()
    return {"headers": headers, "body": body, "verdicts": [], "figure": fig, "notes": notes, "extra": {}}


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.cli_flags import Int, Text

    p = br.script_parser(__doc__, "runs/codec_cost/codec_cost_cpu.json")
    p.add_argument("--label", default="now", type=Text(),
                   help="name of this measurement (rows of other labels in --out are kept)")
    p.add_argument("--micro-batch", type=Int(1), default=16, help="sequences per micro-batch")
    p.add_argument("--seq", type=Int(1), default=1024, help="tokens per sequence")
    p.add_argument("--iters", type=Int(1), default=7, help="timed calls per codec and measure")
    p.add_argument("--warmup", type=Int(0), default=2, help="leading calls dropped")
    p.add_argument("--threads", type=Int(1), default=1,
                   help="OMP threads of the job (1: steadiest on a shared machine)")
    args = br.help_with_defaults(p).parse_args(argv)
    if args.from_json:
        saved = br.read_saved(args.from_json)
    else:
        old = br.read_saved(args.out) if Path(args.out).exists() else {"rows": []}
        rows = measure(args.label, args.micro_batch, args.seq, args.iters, args.warmup, args.threads)
        saved = {"meta": br.run_meta({"threads": args.threads}),
                 "rows": [r for r in old["rows"] if r["label"] != args.label] + rows}
    br.publish_rendered(args.out, saved, TITLE, render(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
