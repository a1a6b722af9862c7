"""Why a row of reproduce/results/PAPER_SCALE.md misses by more than 25%: the clock's term that explains it, and
whether the paper states its setting well enough to model. Keyed by (source, label) of reproduce/paper_scale_rows.py;
written from the breakdowns the script prints beside each note, never used to change a prediction."""
from __future__ import annotations

from typing import Dict, Tuple

from reproduce.paper_scale_rows import B3, B6, BOOST

KERNELS = ("**Compute: GPU kernel efficiency per GEMM shape (a term the paper does not state).** The clock prices "
           "every FLOP at the one fitted throughput, so a speed-up is the FLOP ratio plus the TP tier (NCCL's "
           "collective model on NVLink 3). BOOST's own Fig. 7 (and our H200 check: low-rank factors at 62-76% of the "
           "best GEMM vs 83-98% for full-rank ones at 1B) shows the low-rank GEMMs at a lower fraction of peak, "
           "growing with the batch: the paper's speed-ups are the FLOP ratio times that utilisation ratio. "
           "`make gpu-check STAGES=gemm` times these shapes; `--gemm-efficiency` prices each run's GEMMs at them.")
KERNELS_STATED = ("yes for the layout (A100 80 GB, NVLink 3, TP 4, seq 4096, pure bf16); per-kernel efficiency is the "
                  "missing term, not a missing setting.")
RIGHT = (KERNELS + " The parts miss in opposite directions (over Vanilla-TP ours is 1.59x the paper's, over "
         "FullRank-TP 0.88x): as printed the sentence contradicts the paper's other panels: at the same setting "
         "(CoLA 7B, TP 4, bz 4) the middle panel gives 1.48x over FullRank-TP and the left 'up to 2.28x' over "
         "Vanilla-TP; read with the two numbers swapped ours/paper would be 1.08 and 1.29. The table keeps the text "
         "as printed. SVD, CoLA and LaX have the same matmul FLOPs, so ours cannot tell them apart.")
BZ1 = ("**Compute: kernel efficiency at a small batch (a term the paper does not state).** Ours scales the block "
       "with its FLOPs (bz 1 is a quarter of bz 4's compute: 1,477 us, + 569 us of TP under NCCL's model); the "
       "paper's bz = 1 block takes 0.37x its bz = 4 time, not 0.27x: as the paper says, a smaller per-GPU workload "
       "leaves the kernels memory-bound. The paper's own comm rows put the bz 1 QKV + MLP1 collectives alone at "
       "672 us, more than NCCL's model gives the whole block's TP (nothing is fitted to that). Grouping (the other "
       "Table 3 column) changes launches and GEMM shapes, not FLOPs or bytes.")
_LABELS = {r.label for r in BOOST}


def _label(prefix: str) -> str:
    return next(label for label in _LABELS if label.startswith(prefix))


MISSES: Dict[Tuple[str, str], Tuple[str, str]] = {
    (B3, "CoLA 7B block, ungrouped, bz = 1"): (BZ1, "yes (CoLA 7B, TP 4, seq 4096, bz 1 and 4); whether a block's "
                                              "time includes the backward is not said (forward assumed)."),
    (B3, "CoLA 7B block, grouped, bz = 1"): (BZ1, "yes; see the ungrouped row."),
    (B6, _label("(left) 1B")): (KERNELS, KERNELS_STATED),
    (B6, _label("(left) FullRank-TP vs Vanilla-TP")): (
        KERNELS + " Here the paper names it: vanilla's 'low-A.I. kernels offset FLOP savings' (sec. 4.1); ours has "
                  "vanilla ahead at 3B and 30B (fewer FLOPs) where the paper has it 25% behind.", KERNELS_STATED),
    (B6, _label("(left) BOOST 'up to")): (KERNELS, KERNELS_STATED),
    (B6, _label("(middle)")): (KERNELS, KERNELS_STATED),
    (B6, _label("(right)")): (RIGHT, KERNELS_STATED),
}
