"""The parts of reproduce/results/PLAN.md that follow from the planned runs: what fits one 80 GiB GPU, and what changed
against the table of 2026-11-27 (reproduce/plan_table.py renders them)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

GIB = 2**30
GPU_GIB = 80.0
MARGIN_GIB = 2.0  # the CUDA context (~0.5-1 GiB), NCCL buffers and fragmentation come on top of a plan
# peak of each run's largest planned rank (GiB) in the table of 2026-11-27: memory as meta / CPU keep it (torch's
# composite RMSNorm), the Grassmann update per step, the embedding fold at 8 B
BEFORE = {
    "llama_1b_fullrank": 62.68, "llama_1b_vanilla": 58.40, "llama_1b_btp": 65.90, "llama_3b_fullrank": 73.03,
    "llama_3b_vanilla": 87.03, "llama_3b_btp": 69.73, "llama_7b_fullrank": 80.65, "llama_7b_vanilla": 122.21,
    "llama_7b_btp": 71.88, "llama_13b_fullrank": 117.19, "llama_13b_vanilla": 188.06, "llama_13b_btp": 107.72,
    "llama_30b_fullrank": 161.12, "llama_30b_vanilla": 269.45, "llama_30b_btp": 153.73, "resbm_2b_baseline": 95.44,
    "resbm_2b_100x_adamw": 99.73, "resbm_2b_100x_muon": 93.98, "resbm_2b_128x_adamw": 99.73,
    "resbm_2b_128x_muon": 93.98, "resbm_2b_128x_adamw_1f1b": 42.75, "resbm_2b_baseline_pp8": 14.91,
    "resbm_2b_128x_adamw_pp8": 14.85, "sm_2b_centralised": 21.90, "sm_2b_decentralised": 21.90,
    "sm_2b_compressed": 22.42, "mapl_150m": 8.15, "mapl_500m": 21.50, "mapl_1b": 33.40, "sparseloco_178m": 12.04,
    "sparseloco_512m": 21.19, "sparseloco_1b": 20.41, "sparseloco_512m_het_half": 21.56, "gpu_125m_sdpa": 15.73,
}
BEFORE_BTP_OVER_VANILLA = 0.560  # BOOST Table 4's 7B activation ratio in that table (the paper: 0.720)


def peak(run: Dict[str, Any], switched: bool = False) -> Optional[float]:
    """GiB at the peak of the run's largest planned rank (with its memory switches flipped: None without any)."""
    ranks = run.get("switched", {}).get("ranks") if switched else run["ranks"]
    return max(r["peak_bytes"] for r in ranks) / GIB if ranks else None


def verdicts(runs: Dict[str, Any]) -> str:
    """The two lists of 'What the table says': runs whose largest rank fits 80 GiB as configured, and the others."""
    fit: List[str] = []
    over: List[str] = []
    for name, run in runs.items():
        alt = peak(run, switched=True)
        flip = f" ({alt:.1f} with {', '.join(run['switched']['set'])})" if alt is not None else ""
        close = " (marginal)" if abs(peak(run) - GPU_GIB) <= MARGIN_GIB else ""
        (fit if peak(run) <= GPU_GIB else over).append(f"{name} {peak(run):.1f}{close}{flip}")
    return (f"- **Fits one {GPU_GIB:.0f} GiB GPU as configured** (GiB at the peak of the largest rank, as CUDA "
            f"allocates it): {'; '.join(fit)}.\n- **Does not**: {'; '.join(over)}.\n- Marginal: within "
            f"{MARGIN_GIB:.0f} GiB of {GPU_GIB:.0f} either way, where the CUDA context, NCCL's buffers and the "
            "allocator's fragmentation (not planned) decide; a run marked so that fits here may not on the GPU.")


def what_changed(runs: Dict[str, Any], command: str) -> str:
    """'What changed on 2026-11-28': why, and each run's peak then and now, its verdict at 80 GiB marked."""
    lines = [
        "## What changed on 2026-11-28", "",
        f"Every run re-planned (`{command}`; issue 39):", "",
        "- **Memory as a GPU allocates it** (`python -m nanotron_ext.plan --device cuda`, now the default; the JSON "
        "records `device`). On the meta device, as on the CPU, torch runs `F.rms_norm` as its composite, and autograd "
        "keeps the fp32 normalised x * rstd beside the input: 4 N d bytes per norm and micro-batch in flight that "
        "CUDA's fused kernel does not keep (it keeps input and rstd). Every `F.rms_norm` is now planned as that kernel "
        "(docs/planning.md lists every op checked, CPU against CUDA). BOOST's btp normalises by hand inside its "
        "chunks: only its final norm changed.",
        "- **Step-gated work at its cadence**: SM's Grassmann update (a 128 MiB world all-reduce at d = 4096) was "
        "counted in every step; it is now a tier row of its own, `every 500 steps`, and out of the per-step figures. "
        "Heterogeneous SparseLoCo's embedding fold is a row `every 50 steps`, at its bound (it was planned at 8 B, the "
        "count alone, and shown nowhere).",
        "- **Text**: SM's wire is (k + 2) x 2 B per token (the token id is an int32); vanilla BOOST's 0.875x of its "
        "Table 6 form is explained (its backward, below the tier table).", "",
        "| run | peak GiB, 2026-11-27 (meta / CPU memory) | peak GiB now (CUDA) | fits 80 GiB then -> now |",
        "|---|---|---|---|"]
    for name, run in runs.items():
        before, now = BEFORE.get(name), peak(run)
        if before is None:
            continue
        verdict = lambda g: "yes" if g <= GPU_GIB else "no"  # noqa: E731
        flipped = verdict(before) != verdict(now)
        lines.append(f"| {name} | {before:.2f} | {now:.2f} | "
                     f"{'**' if flipped else ''}{verdict(before)} -> {verdict(now)}{'**' if flipped else ''} |")
    return "\n".join(lines)
