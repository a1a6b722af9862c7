"""Every paper-scale config of reproduce/ planned on this machine (python -m nanotron_ext.plan), beside the papers.

    .venv/bin/python reproduce/plan_table.py [--only NAME ...] [--from-json reproduce/results/PLAN.json]

Writes reproduce/results/PLAN.json (each run's full plan: every planned rank, every tier) and
reproduce/results/PLAN.md (per rank role: peak memory and its parts, TFLOP per step; bytes per tier per step beside
the closed forms; the papers' figures where they state one). A run already in the JSON is kept unless named with --only.
"""
from __future__ import annotations

import datetime
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from reproduce.plan_notes import BEFORE_BTP_OVER_VANILLA, verdicts, what_changed  # noqa: E402

COMMAND = ".venv/bin/python reproduce/plan_table.py --only <every run>"  # how this table was made, 2026-11-28

OUT = REPO / "reproduce" / "results" / "PLAN"
RESBM_TABLE3 = ["parallelism.pp=8", "parallelism.pp_engine=afab", "model.codec.boundaries=stages",
                "tokens.micro_batch_size=1", "tokens.batch_accumulation_per_replica=16"]  # the YAML header's 8-GPU row
HET_HALF = ["sparseloco.compressed_replicas=[4,5,6,7]", "model.subspace.k=192"]  # the YAML header's Het-PP-Compress
BOOST = [f"boost/llama_{size}_{kind}" for size in ("1b", "3b", "7b", "13b", "30b")
         for kind in ("fullrank", "vanilla", "btp")]
RUNS: Dict[str, Tuple[str, List[str]]] = {
    **{name.split("/")[1]: (f"reproduce/{name}.yaml", []) for name in BOOST},
    **{f"resbm_2b_{v}": (f"reproduce/resbm/resbm_2b_{v}.yaml", []) for v in
       ("baseline", "100x_adamw", "100x_muon", "128x_adamw", "128x_muon")},
    "resbm_2b_128x_adamw_1f1b": ("reproduce/resbm/resbm_2b_128x_adamw.yaml", ["parallelism.pp_engine=1f1b"]),
    "resbm_2b_baseline_pp8": ("reproduce/resbm/resbm_2b_baseline.yaml", RESBM_TABLE3),
    "resbm_2b_128x_adamw_pp8": ("reproduce/resbm/resbm_2b_128x_adamw.yaml", RESBM_TABLE3),
    **{f"sm_2b_{v}": (f"reproduce/sm/sm_2b_{v}.yaml", []) for v in ("centralised", "decentralised", "compressed")},
    **{f"mapl_{s}": (f"reproduce/mapl/mapl_{s}.yaml", []) for s in ("150m", "500m", "1b")},
    **{f"sparseloco_{s}": (f"reproduce/het_sparseloco/sparseloco_{s}.yaml", []) for s in ("178m", "512m", "1b")},
    "sparseloco_512m_het_half": ("reproduce/het_sparseloco/sparseloco_512m.yaml", HET_HALF),
    "gpu_125m_sdpa": ("examples/config_125m_gpu.yaml", ["model.compile=false"]),  # gpu-check's "sdpa" throughput row
}
# benchmarks/results/gpu/2026-11-27-h200/call1/gpu_check.json, throughput row "sdpa", models.nanotron_ext:
# torch.cuda.max_memory_allocated over one training step of ours, with the plain reference model (and its AdamW state)
# resident beside it
H200_125M_SDPA_PEAK = 17_282_551_296
DEVICE = "cuda"  # memory as a GPU allocates it (python -m nanotron_ext.plan --device)
GIB, MIB = 2**30, 2**20


def plan_run(name: str) -> Dict[str, Any]:
    from nanotron_ext.config import load_config
    from nanotron_ext.plan.__main__ import plan
    from nanotron_ext.plan.run import default_ranks

    config_file, overrides = RUNS[name]
    cfg = load_config(REPO / config_file, overrides)
    t0 = time.perf_counter()
    summary = plan(str(REPO / config_file), overrides, cfg, default_ranks(cfg), DEVICE)
    return {"config": config_file, "set": overrides, "wall_s": round(time.perf_counter() - t0, 1), **summary}


# -- the papers' figures -----------------------------------------------------------------------------------------
def _rank0(runs: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    return runs[name]["ranks"][0] if name in runs else None


def _links(run: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [t for t in run["tiers"] if t["tier"].startswith("PP")]


def paper_rows(runs: Dict[str, Any]) -> List[Tuple[str, str, str, str, str]]:
    """(what, paper, ours, ours / paper, why they differ)."""
    rows = []
    # BOOST Table 4: CoLA LLaMA-7B, bz 4, seq 4k, TP 4, memory per TP rank, GB
    paper = {"vanilla": (1.25, 1.25, 2.50, 30.73), "btp": (1.25, 1.25, 2.50, 22.14)}
    for kind, (w, g, o, a) in paper.items():
        r = _rank0(runs, f"llama_7b_{kind}")
        if r is None:
            continue
        for what, p, ours in (("weights", w, r["parameter_bytes"]), ("gradients", g, r["gradient_bytes"]),
                              ("AdamW state", o, r["optimizer_state_bytes"]),
                              ("activations", a, r["activation_bytes_at_peak"])):
            why = {"weights": "fp32 master weights (autocast); the paper's 1.25 GB is 2 B per parameter (sec. 5.2: "
                              "pure bf16)",
                   "gradients": "fp32 gradients of the fp32 master weights",
                   "AdamW state": "2 fp32 moments of fp32 weights, as the paper's 2x weights",
                   "activations": "ours: every tensor alive at the step's peak besides the state (activations, "
                                  "their gradients, temporaries) of our autocast model: fp32 residual stream and "
                                  "norms, fp32 logits in the sharded cross-entropy, bf16 weight copies; the paper "
                                  "runs pure bf16 (sec. 5.2)"}[what]
            rows.append((f"BOOST Table 4, 7B {kind}, {what} per TP rank", f"{p:.2f} GB", f"{ours / 1e9:.2f} GB",
                         f"{ours / 1e9 / p:.2f}", why))
    v, b = _rank0(runs, "llama_7b_vanilla"), _rank0(runs, "llama_7b_btp")
    if v and b:
        rows.append(("BOOST Table 4, 7B activations btp / vanilla", f"{22.14 / 30.73:.3f}",
                     f"{b['activation_bytes_at_peak'] / v['activation_bytes_at_peak']:.3f}",
                     f"{b['activation_bytes_at_peak'] / v['activation_bytes_at_peak'] / (22.14 / 30.73):.2f}",
                     f"the ratio is what transfers across precisions and kernels ({BEFORE_BTP_OVER_VANILLA:.3f} "
                     "before the plan kept CUDA's fused RMSNorm, 2026-11-27)"))
    # ResBM appendix A.3: one 1 x 1024 micro-batch, one boundary, both directions, bf16
    for name, paper_b, label in (("resbm_2b_baseline_pp8", 16 * MIB, "uncompressed"),
                                 ("resbm_2b_128x_adamw_pp8", 128 * 1024, "128x")):
        if name in runs:
            link = max(t["ledger_bytes"] for t in _links(runs[name])) / 16  # 16 micro-batches per step
            rows.append((f"ResBM A.3 {label}: bytes per boundary per 1x1024 micro-batch, both ways",
                         f"{paper_b:,} B", f"{link:,.0f} B", f"{link / paper_b:.3f}",
                         "equal: h x 2 B per token each way" if abs(link / paper_b - 1) < 1e-9 else
                         "see the tier rows"))
    # SM: the ratio was lost in the paper's text; our YAML chose k = 40 (~100x)
    if "sm_2b_compressed" in runs and "sm_2b_decentralised" in runs:
        c = max(t["ledger_bytes"] for t in _links(runs["sm_2b_compressed"]))
        u = max(t["ledger_bytes"] for t in _links(runs["sm_2b_decentralised"]))
        rows.append(("SM 2B: wire bytes uncompressed / compressed per link", "not stated (lost in the text)",
                     f"{u / c:.1f}x", "-", "k = 40 of d = 4096 (CHOICE) plus the int32 token id in the wire: "
                     "(k + 2) x 2 B per token against d x 2 B"))
    # SparseLoCo: k = 32 of every 4096-entry chunk, 12-bit index + bf16 value, no quantisation (paper sec. 2)
    for name in ("sparseloco_178m", "sparseloco_512m", "sparseloco_1b", "sparseloco_512m_het_half"):
        if name not in runs:
            continue
        dp = [t for t in runs[name]["tiers"] if t["tier"].startswith("DP")]
        if dp:
            ours, form = dp[0]["ledger_bytes"], dp[0]["closed_form_bytes"]
            rows.append((f"SparseLoCo {name[11:]}: payload per replica per outer step", f"{form / 1e6:.2f} MB "
                         "(k 32 / 4096, 12-bit index, bf16 value)", f"{ours / 1e6:.2f} MB", f"{ours / form:.3f}",
                         "ours adds the 4-byte loss all-reduce per step; chunking of small tensors as the closed form"))
    # MAPL: r = 256 at d = 1024 / 1536 / 2048 -> 4x / 6x / 8x
    for size, d in (("150m", 1024), ("500m", 1536), ("1b", 2048)):
        name = f"mapl_{size}"
        if name in runs:
            tokens = runs[name]["tokens_per_replica_step"]
            wire = [t for t in runs[name]["tiers"] if t["tier"].startswith("PP")][0]
            per_token = wire["ledger_bytes"] / (2 * tokens)
            rows.append((f"MAPL {size}: activation compression d / r", f"{d / 256:.0f}x",
                         f"{d * 2 / per_token:.2f}x", f"{d * 2 / per_token / (d / 256):.2f}",
                         "ours counts every wire byte: r bf16 values, the int32 token id, and the once-per-step "
                         "exchange of the shared parameters' gradients (its rows of distinct token ids planned at "
                         "their fewest, one)"))
    if "gpu_125m_sdpa" in runs:
        ours = _rank0(runs, "gpu_125m_sdpa")["peak_bytes"]
        gap = ours - H200_125M_SDPA_PEAK
        rows.append(("125M on 1x H200 (gpu-check 2026-11-27, eager SDPA): peak allocated",
                     f"{H200_125M_SDPA_PEAK / 1e9:.2f}"
                     " GB measured (ours + the plain model resident)", f"{ours / 1e9:.2f} GB (ours alone)",
                     f"{ours / H200_125M_SDPA_PEAK:.2f}", "not a clean check: the measurement also holds the plain "
                     "reference model's weights and AdamW state (~1.5 GB), so the plan is "
                     f"{abs(gap) / 1e9:.2f} GB {'above' if gap > 0 else 'below'} the measurement with ~1.5 GB less "
                     "resident"))
    return rows


NOTES_TIERS = """PP and DP: the ledger equals the closed form wherever the form is exact (ResBM, SM, SparseLoCo; MAPL's
form bounds the shared-parameter exchange, whose rows of distinct ids the plan takes at their fewest). TP: Megatron's
form counts every all-reduce at the compute dtype's 2 B, but under bf16 autocast the two input-gradient all-reduces
per layer in backward cross in fp32 (nanotron's column-parallel linear reduces the gradient of its fp32 input) and
so does the embedding's output: the ledger reads 1.51x (a real CPU gloo run's ledger reads the same bytes:
tests/test_plan.py, bf16 at TP 2). BOOST's Table 6 forms leave out the
norm statistics, embedding and head (btp 1.02x). Vanilla's ledger reads 0.875x of its form because of its backward:
the form counts the backward like the forward (3bsd + 2bs*kv + 2bs*d_ff elements per block at 2 B), but only the
first factors' column-parallel inputs all-reduce their gradients there, one per chunk: q/k/v's and gate/up's shared
inputs (d wide each), o's (d) and down's (d_ff), 3bsd + bs*d_ff elements, the two shared ones in fp32 (the gradient of
the fp32 norm output under autocast): 10bsd + 2bs*d_ff bytes against the form's 10bsd + 4bs*d_ff. With the forward's
10bsd + 4bs*d_ff that is 0.870-0.871 of the form at every size (MHA); the rest is the embedding output's and the head
input gradient's fp32 all-reduces (2 x 4bsd per micro-batch) and the cross-entropy's per-token statistics, to the
byte (1B-30B vanilla, checked against the ledger)."""

WHY = """- Why: with `pp_engine: afab` at pp = 1 (the ResBM 2B one-GPU configs) the engine keeps all 8 micro-batches'
  activations until the backward (`--set parallelism.pp_engine=1f1b`: resbm_2b_128x_adamw_1f1b); 1F1B keeps pp
  micro-batches in flight on a first stage (BOOST 13B, 30B); BOOST's low-rank checkpointing
  (`model.boost.lowrank_checkpointing=true`, in brackets) about halves the low-rank runs' peaks.
- Peaks are tensors alive at once as CUDA keeps them (MemTracker on meta tensors; with `--device cpu` checked against
  the CPU allocator within 10%, whose own peak moves by up to ~9% between runs; tests/test_plan.py); on a GPU add
  the CUDA context (~0.5-1 GiB), NCCL buffers and allocator fragmentation."""

NOTES = """## Limits of the plan

- The meta device, not FakeTensorMode: `nn.Parameter` of a FakeTensor stays a FakeTensor, not nanotron's
  `NanotronParameter`, which nanotron's TP layers need. torch.autocast has no meta backend: bf16 is planned by
  casting at the torch-function level with CUDA autocast's op lists (abridged; nanotron_ext/plan/kernels.py);
  checked against CPU autocast (bf16 at tp 2: 0.5-2.9%). Attention is the fused kernel's memory (output +
  log-sum-exp), as flash / cuDNN / memory-efficient attention on a GPU; RMSNorm CUDA's fused kernel's (input +
  rstd kept); the optimiser step and clipping are planned as the CPU runs them (per-parameter temporaries CUDA's
  fused kernels do not make; docs/planning.md).
- No values: every value reads as 0. Sizes that depend on data take their fewest (MAPL's rows of distinct token
  ids) or, where the fewest says nothing, their bound (heterogeneous SparseLoCo's fold: the outer step's entries);
  guards take their ordinary path; work gated on a step counter runs in the planned step and is shown at its
  cadence (`every N steps` rows).
- A pipeline's stages run together (their message headers cross through a real TCPStore, nanotron_ext/plan/wire.py);
  TP ranks of a stage are taken to be alike (TP rank 0 planned).
- `model.compile` is planned eager (an upper bound); FLOPs count causal attention in full (torch's formulas: the
  flash backward's recomputation included, 7/6 of PaLM's attention term)."""


# -- the report --------------------------------------------------------------------------------------------------
def _g(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render(saved: Dict[str, Any]) -> str:
    runs = saved["runs"]
    lines = ["# Paper-scale configs planned on one machine", "",
             f"{saved['machine']}, {saved['date']}; `python -m nanotron_ext.plan` on each config "
             "(`reproduce/plan_table.py`; JSON: `reproduce/results/PLAN.json`).", "",
             "Each planned rank is rank R of the config's real layout, built in its own process over torch's fake "
             "process group on the meta device, and steps a full training iteration (all micro-batches through the "
             "pipeline engine with its neighbours' real message headers, DP sync, clipping, AdamW/Muon, and the DP "
             "sync's outer step where it has one). Memory is torch's MemTracker, as CUDA keeps the tensors "
             "(`--device cuda`: RMSNorm's fused kernel; tensors alive at once: the CUDA "
             "context, NCCL buffers and allocator fragmentation come on top); FLOPs torch's FlopCounterMode; bytes "
             "the comm ledger. GiB throughout; TP rank 0 of each distinct replica, every stage.", "",
             what_changed(runs, COMMAND), "",
             "## Per rank role", "",
             "| run | layout | rank | role | params | weights | grads | optimizer | DP-sync state | activations | "
             "peak GiB | peak, switches flipped | TFLOP/step |", "|" + "---|" * 13]
    for name, run in runs.items():
        lay = run["layout"]
        flip = {r["rank"]: r for r in run.get("switched", {}).get("ranks", [])}
        seen = set()
        for r in run["ranks"]:
            role = r["role"].split(" (")[0] + f", {r['codec']}"
            key = (role, r["peak_bytes"], r["parameters"])
            if key in seen:
                continue  # identical middle stages: one row
            seen.add(key)
            alt = flip.get(r["rank"])
            lines.append(f"| {name} | {lay['dp']}x{lay['tp']}x{lay['pp']} | {r['rank']} | {role} | "
                         f"{r['parameters'] / 1e6:,.1f}M | {_g(r['parameter_bytes'])} | {_g(r['gradient_bytes'])} | "
                         f"{_g(r['optimizer_state_bytes'])} | {_g(r['dp_sync_state_bytes'])} | "
                         f"{_g(r['activation_bytes_at_peak'])} | **{_g(r['peak_bytes'])}** | "
                         f"{_g(alt['peak_bytes']) + ' (' + ', '.join(run['switched']['set']) + ')' if alt else '-'} | "
                         f"{r['flops'] / 1e12:,.1f} |")
    lines += ["", "## Bytes per step by tier (ledger beside `config show`'s closed form)", "",
              "| run | replica | tier | ledger | closed form | ratio |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        for t in run["tiers"]:
            ratio = "-" if t["ratio"] is None else f"{t['ratio']:.4f}"
            replica = "-" if t["replica"] is None else f"{t['replica']} ({t['codec']})"
            lines.append(f"| {name} | {replica} | {t['tier']} | {_bytes(t['ledger_bytes'])} | "
                         f"{_bytes(t['closed_form_bytes'])} | {ratio} |")
    lines += ["", NOTES_TIERS, "", "## Beside the papers", "", "| quantity | paper | ours | ours / paper | why |",
              "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in paper_rows(runs)]
    lines += ["", "## What the table says", "", verdicts(runs), WHY, "", NOTES]
    lines += ["", "## Runs", "", "| run | config | --set | planning wall s |", "|---|---|---|---|"]
    lines += [f"| {n} | `{r['config']}` | {' '.join(r['set']) or '-'} | {r['wall_s']} |" for n, r in runs.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_flags import Parser

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="plan these runs (default: all not yet saved)")
    parser.add_argument("--from-json", action="store_true", help="re-render PLAN.md from PLAN.json, plan nothing")
    args = parser.parse_args(argv)
    path = OUT.with_suffix(".json")
    from nanotron_ext.cli_checks import ArgumentError, Writer, output_files, refuse
    from nanotron_ext.plan.cached import read_plan_table

    table = Writer("reproduce/plan_table.py", legacy_keys=("date", "machine", "runs"))
    try:  # replaced only when this script wrote them (cli_checks.Writer)
        output_files("output", path, table, [OUT.with_suffix(".md")])
    except ArgumentError as e:
        refuse(e)
    try:  # a damaged table: refused by name (nanotron_ext.plan.cached), not a traceback
        saved = read_plan_table(path) if path.exists() else {"runs": {}}
    except ArgumentError as e:
        refuse(e)
    if not args.from_json:
        todo = args.only or [n for n in RUNS if n not in saved["runs"]]
        for name in todo:
            print(f"planning {name} ...", flush=True)
            try:
                saved["runs"][name] = plan_run(name)
            except Exception as e:  # noqa: BLE001 - the other runs go on; the error is reported at the end
                print(f"{name} failed: {str(e)[-3000:]}", flush=True)
                continue
            saved["runs"] = {n: saved["runs"][n] for n in RUNS if n in saved["runs"]}  # the table's order
            saved.update(date=datetime.date.today().isoformat(),
                         machine=f"CPU ({platform.machine()}, 2 cores shared), torch fake process group + meta device, "
                                 f"memory as {DEVICE.upper()} allocates it (--device {DEVICE})")
            table.write_json(path, saved, indent=1)  # after every run: an interrupted table keeps its rows
    table.write_markdown(OUT.with_suffix(".md"), render(saved))
    print(f"wrote {OUT.with_suffix('.md')} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
