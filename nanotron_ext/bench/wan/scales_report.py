"""What `python -m nanotron_ext.bench.wan.scales report` writes beside the numbers: the papers' published penalties at
their scale (PAPERS, read from their tables by hand and stated with how each was read) and the Markdown.

A paper's number is rarely a step ratio: most report a final loss (or perplexity) of the compressed run against the
baseline at the same tokens, which says how far behind it ends, not how many more steps it needs. `kind` says which.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Mapping, Optional

HET = "Heterogeneous Low-Bandwidth Pre-Training of LLMs (heterogeneous SparseLoCo)"
SM = "Protocol Models: Scaling Decentralized Training with Communication-Efficient Model Parallelism (arXiv:2506.01260)"
RESBM = "ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism (arXiv:2604.11947)"
MAPL = "Learned Subspace Compression for Communication-Efficient Pipeline Parallelism (MAPL, arXiv:2606.05484)"
BOOST = "BOOST: Bottleneck-Optimized Scalable Training Framework for Low-Rank Large Language Models (arXiv:2512.12131)"
DILOCO = "DiLoCo: Distributed Low-Communication Training of Language Models (arXiv:2311.08105)"
LOSS_RATIO = "loss ratio at equal tokens"


def _p(paper: str, table: str, scale: str, system: str, penalty: Optional[float], kind: str, how: str
       ) -> Dict[str, Any]:
    return {"paper": paper, "table": table, "scale": scale, "system": system,
            "penalty": None if penalty is None else round(penalty, 4), "kind": kind, "how": how}


PAPERS: List[Dict[str, Any]] = [
    _p(HET, "Table 1", "178M, DCLM, 3B tokens", "SparseLoCo + Het-PP-Compress (1/2), 87.5%", 3.12 / 3.07, LOSS_RATIO,
       "final loss 3.12 / SparseLoCo baseline 3.07 (baseline: SparseLoCo, not per-step AdamW)"),
    _p(HET, "Table 1", "512M, DCLM, 10B tokens", "SparseLoCo + Het-PP-Compress (1/2), 87.5%", 2.82 / 2.73, LOSS_RATIO,
       "final loss 2.82 / SparseLoCo baseline 2.73 (same inner and outer steps)"),
    _p(HET, "Table 3(a)", "512M, DCLM", "SparseLoCo + Het-PP-Compress (1/2), 87.5%", 1.2, "token ratio, lower bound",
       "at 12B tokens (1.2x) it ends at 2.75, still above the baseline's 2.73 at 10B: it needs more than 1.2x the "
       "tokens to match, the only step-like reading any of these tables allows"),
    _p(HET, "Table 6", "1B, DCLM, 10B tokens", "SparseLoCo + PP-Compression, 87.5%", 2.910 / 2.747, LOSS_RATIO,
       "final loss 2.910 / SparseLoCo baseline 2.747"),
    _p(HET, "Tables 1 and 3", "512M, DCLM, 10B tokens", "SparseLoCo (vs per-step AdamW)", 2.73 / 2.75, LOSS_RATIO,
       "SparseLoCo baseline 2.73 (Table 1) / AdamW 2.75 (Table 3): read across two tables of the same setting"),
    _p(HET, "Table 3", "512M, DCLM, 10B tokens", "AdamW + heterogeneous PP-compression 1/8", 2.83 / 2.75, LOSS_RATIO,
       "final loss 2.83 / per-step AdamW 2.75 (no outer loop)"),
    _p(SM, "Table 1", "2B (8 layers), WikiText / BookCorpus / OWT", "SM compressed (80 Mbit/s) vs centralized",
       46.75 / 47.22, "perplexity ratio at equal time (~equal tokens: 592 vs 603 tokens/s)",
       "OpenWebText validation perplexity 46.75 / 47.22 (BookCorpus 17.63 / 18.35, WikiText 23.01 / 23.08)"),
    _p(SM, "Table 2", "640M, C4, ~12B tokens", "SM compressed vs centralized", 12.53 / 12.61,
       "perplexity ratio at equal tokens", "C4 validation perplexity 12.53 / 12.61 (BookCorpus 12.67 / 12.79)"),
    _p(RESBM, "Table 2", "2B, C4, 26B tokens", "ResBM 128x (Muon) vs AdamW baseline", 21.77 / 21.75,
       "perplexity ratio at equal tokens", "final perplexity 21.77 / 21.75 (100x: 21.60)"),
    _p(RESBM, "Table 3", "2B, C4, 12 h on 8 A10G", "ResBM 128x (AdamW) at 80 Mbit/s vs centralized at 10 Gbit/s",
       4.05 / 3.86, "loss ratio at equal time (1.04x the tokens: 7,837 vs 7,530 tokens/s)",
       "final training loss 4.05 / 3.86 (Muon 3.98)"),
    _p(MAPL, "Main results (P = 8)", "150M, DCLM, Chinchilla tokens", "SSN (SM) 4x", 3.40 / 3.13, LOSS_RATIO,
       "validation loss 3.40 / uncompressed 3.13 (MAPL 3.165: 1.011)"),
    _p(MAPL, "Main results (P = 8)", "500M, DCLM, Chinchilla tokens", "SSN (SM) 6x", 3.12 / 2.84, LOSS_RATIO,
       "validation loss 3.12 / uncompressed 2.84 (MAPL 2.84: 1.000)"),
    _p(MAPL, "Main results (P = 8)", "1B, DCLM, Chinchilla tokens", "SSN (SM) 8x", 3.08 / 2.68, LOSS_RATIO,
       "validation loss 3.08 / uncompressed 2.68 (MAPL 2.73: 1.019): SM's gap grows with size in this table"),
    _p(MAPL, "Main results (P = 8)", "1B, DCLM, Chinchilla tokens", "MAPL 8x", 2.73 / 2.68, LOSS_RATIO,
       "validation loss 2.73 / uncompressed 2.68"),
    _p(BOOST, "none", "CoLA LLaMA 7B (speed); tiny LLaMA (Figure 4 loss curves)", "BTP", None, "not available",
       "BOOST publishes speed-ups only; its one loss figure shows BTP's curve on TP=1's (no number), and the "
       "low-rank model's own loss against full rank is CoLA's, not given in BOOST"),
    _p(DILOCO, "not read", "150M-400M (C4)", "DiLoCo (outer Nesterov)", None, "not available",
       "the paper is not among the papers given to this project and its tables were not found through the search "
       "tool, so no number of it is cited"),
]


def _pm(values: List[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values) / len(values) ** 0.5)}"


def _steps(hits: List[Optional[int]]) -> str:
    return " / ".join("-" if h is None else str(h) for h in hits)


def _penalty(row: Optional[Mapping[str, Any]]) -> str:
    if row is None:
        return "not run"
    if row["penalty"] is None:
        return f"not reached in {row['budget']} ({row['reached']})"
    k, n = row["reached"].split("/")
    return f"{row['penalty']:.2f}" + ("" if k == n else f" ({row['reached']}: lower bound)")


def markdown(data: Mapping[str, Any], detail: Mapping[str, Mapping[str, Any]],
             best_single: Callable[[Dict[str, Any]], Optional[str]]) -> str:
    """The Markdown of the loss-scale study: one table per size, the penalties side by side, the papers'."""
    lines = ["# Per-token penalty against dense 3D at two model sizes (issue 51 item 3)", "",
             f"Written {data['date']} by `python -m nanotron_ext.bench.wan.scales report` from the cached loss runs; "
             f"{data['device']}. Penalty = mean steps to target / dense 3D's mean steps to target (first validation at "
             "or below dense 3D's final validation loss x 1.02, mean over its seeds, at that size). A system trains "
             "dense 3D's budget, or 3x it (its own cosine schedule; the budget column) where it does not reach the "
             "target within dense's budget; its row is from the shortest budget at which every seed reached. "
             "Loss-only: no step time.", ""]
    for size in data["sizes"]:
        rows = detail[size["name"]]
        best = best_single(rows)
        lines += [f"## {size['name']}: d = {size['hidden_size']}, {size['non_embedding_params']:,} non-embedding "
                  f"parameters", "",
                  f"Dense 3D: {size['steps']} steps of {size['tokens_per_step']:,} tokens, seeds "
                  f"{', '.join(map(str, size['seeds']))}; target {size['target']:.4f}. Corpus "
                  f"{size['corpus_tokens']:,} training tokens; the longest budget read is "
                  f"{size['epochs_at_longest']:.2f} epochs (no run repeats data). Best single technique by steps to "
                  f"target: {best or 'none reached'}.", "",
                  "| system | budget (steps) | seeds | final val | steps to target (per seed) | reached | penalty | "
                  "wall s per run | CPU s per run |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            wall = [s for s in r["train_s"] if s is not None]
            cpu = " / ".join("-" if c is None else f"{c:.0f}" for c in r["cpu_s"])
            lines.append(f"| `{name}` | {r['budget']} | {', '.join(map(str, r['seeds']))} | {_pm(r['final_val'])} | "
                         f"{_steps(r['steps_to_target'])} | {r['reached']} | {_penalty(r)} | "
                         f"{_pm(wall, '{:.0f}')} | {cpu} |")
        control = rows.get("dense_3d", {}).get("long_control", {})
        if control.get("seeds"):
            lines += ["", f"Schedule control: dense 3D over the {control['budget']}-step cosine (seeds "
                      f"{', '.join(map(str, control['seeds']))}) reaches the target at step "
                      f"{_steps(control['steps_to_target'])}: the long-budget rows' penalty against it is their steps "
                      "over this (their schedule is the same)."]
        lines.append("")
    names = [n for n in dict.fromkeys(n for s in data["sizes"] for n in detail[s["name"]])]
    lines += ["## The penalty by size", "", "| system | " + " | ".join(s["name"] for s in data["sizes"]) + " |",
              "|---|" + "---|" * len(data["sizes"])]
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join(_penalty(detail[s["name"]].get(n)) for s in data["sizes"]) + " |")
    lines += ["", "## The papers' penalties at their scale", "",
              "Read by hand from each paper's table (nanotron_ext/bench/wan/scales_report.py); `kind` says what the "
              "number is. A loss or perplexity ratio at equal tokens is how far behind a run ends, not how many more "
              "steps it needs: it is not comparable to the step ratios above except in direction.", "",
              "| paper | table | scale | system | penalty | kind | how |", "|---|---|---|---|---|---|---|"]
    for p in data["papers"]:
        pen = "-" if p["penalty"] is None else f"{p['penalty']:.3f}"
        lines.append(f"| {p['paper']} | {p['table']} | {p['scale']} | {p['system']} | {pen} | {p['kind']} | "
                     f"{p['how']} |")
    return "\n".join(lines) + "\n"
