"""The WAN meter's systems: one row each, how it is launched in its real layout (processes, config keys).
Every system trains the same model, data and token budget (reproduce/wan/cpu_base.yaml) unless it has its own YAML."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from nanotron_ext.bench.wan.args import config_file
from nanotron_ext.bench.wan.presets import ANCHORS, tier_links

REPO = Path(__file__).resolve().parents[3]
BASE = "reproduce/wan/cpu_base.yaml"
THREE_TIERS = "examples/config_three_tiers.yaml"
SM = ["model.codec.kind=subspace", "model.embedding.kind=subspace", "model.output_constraint.kind=subspace",
      "model.subspace.k=16"]


@dataclasses.dataclass(frozen=True)
class System:
    """One row of the meter: how it is launched (processes, config keys) and which tiers its traffic crosses."""

    label: str
    nproc: int
    overrides: Tuple[str, ...]
    config: Optional[str] = None  # its own YAML instead of --config (the three-tier composition)


PIPE = ("parallelism.pp=2", "parallelism.dp=1", "tokens.batch_accumulation_per_replica=4")
DATA = ("parallelism.pp=1", "parallelism.dp=2", "tokens.batch_accumulation_per_replica=2")
DATA4 = ("parallelism.pp=1", "parallelism.dp=4", "tokens.batch_accumulation_per_replica=1")
TP2 = ("parallelism.pp=1", "parallelism.dp=1", "parallelism.tp=2", "tokens.batch_accumulation_per_replica=4")
LOW_RANK = ("model.low_rank.kind=svd", "model.low_rank.rank=32")  # d/4 at cpu_base.yaml's d = 128
DENSE_TP = ("model.low_rank.kind=none", "model.tp_strategy=megatron")  # the three-tier file's TP made dense
ALLREDUCE = ("parallelism.dp_sync=allreduce", "sparseloco=null")  # its DP tier made a per-step all-reduce
DENSE_3D = DENSE_TP + ALLREDUCE
DENSE_OUTER = ("sparseloco.compressed_replicas=[]", "sparseloco.topk=4096")  # top-k of all 4,096: every entry sent
DILOCO_OUTER = ("sparseloco.outer_lr=0.7", "sparseloco.outer_momentum=0.9", "sparseloco.outer_nesterov=true")
STREAMING = "sparseloco.streaming.delay=1"  # tau = 1 inner step; alpha keeps its default 0.5
SYSTEMS: Dict[str, System] = {
    "pipeline": System("uncompressed pipeline (pp=2)", 2, PIPE),
    "subspace_pipeline": System("SM subspace codec k=d/8 (pp=2)", 2, PIPE + tuple(SM)),
    "resbm_pipeline": System("ResBM 128x (pp=2)", 2, PIPE + ("model.codec.kind=resbm", "model.codec.resbm.h=1")),
    "ddp": System("DP all-reduce every step (dp=2)", 2, DATA),
    "sparseloco": System("SparseLoCo (dp=2; --inner-steps)", 2, DATA + ("parallelism.dp_sync=sparseloco",)),
    # opt-in rows (not in DEFAULT_SYSTEMS; resolved by tests/test_wan_meter.py, not yet in a committed result)
    # the streaming outer sync (sparseloco.streaming: the all_gather behind tau = 1 inner step, merged with alpha 0.5)
    "sparseloco_streaming": System("SparseLoCo, streaming outer sync (tau = 1, alpha = 0.5; dp=2; --inner-steps)", 2,
                                   DATA + ("parallelism.dp_sync=sparseloco", "sparseloco.streaming.delay=1")),
    # the same with tau = 4 (needs --inner-steps > 4): enough inner steps to hide a slow link's whole sync
    "sparseloco_streaming4": System("SparseLoCo, streaming outer sync (tau = 4, alpha = 0.5; dp=2; --inner-steps)", 2,
                                    DATA + ("parallelism.dp_sync=sparseloco", "sparseloco.streaming.delay=4")),
    "topk_pipeline": System("lossy top-k 8x (pp=2)", 2, PIPE + ("model.codec.kind=topk", "model.codec.ratio=8")),
    "int4_pipeline": System("lossy int4 (pp=2)", 2, PIPE + ("model.codec.kind=int4",)),
    "lowrank_pipeline": System("lossy low-rank 8x (pp=2)", 2,
                               PIPE + ("model.codec.kind=lowrank", "model.codec.ratio=8")),
    "mapl_pipeline": System("MAPL (pp=2)", 2, PIPE + ("model.codec.kind=mapl",)),
    "mapl_vq_pipeline": System("MAPL + VQ (pp=2)", 2, PIPE + ("model.codec.kind=mapl", "model.codec.mapl.vq_groups=32",
                                                             "model.codec.mapl.vq_rounds=2",
                                                             "model.codec.mapl.vq_codebook=16")),
    "het_sparseloco": System("heterogeneous SparseLoCo, replica 0 subspace-compressed (dp=2 x pp=2)", 4,
                             ("parallelism.pp=2", "parallelism.dp=2", "tokens.batch_accumulation_per_replica=2",
                              "parallelism.dp_sync=sparseloco", "sparseloco.compressed_replicas=[0]",
                              "model.subspace.k=16")),
    # BOOST: BTP inside each stage (tp=2 on --tp-preset) of a low-rank (SVD, rank d/4) model, its sharded wire
    # across the stage link as is; beside it, the same low-rank model without TP
    "svd_pipeline": System("SVD low-rank r=d/4 (pp=2)", 2, PIPE + LOW_RANK),
    "btp_pipeline": System("BOOST BTP, SVD low-rank r=d/4 (tp=2 x pp=2)", 4,
                           PIPE + LOW_RANK + ("parallelism.tp=2", "model.tp_strategy=btp")),
    # Megatron TP of the dense model (tp=2): the TP tier's uncompressed traffic (the calibrated presets measure it);
    # BOOST's comparison on the same TP layout: the low-rank model under vanilla TP and under BTP
    "megatron_tp": System("Megatron TP (tp=2)", 2, TP2 + ("model.tp_strategy=megatron",)),
    "vanilla_tp": System("vanilla TP, SVD low-rank r=d/4 (tp=2)", 2, TP2 + LOW_RANK + ("model.tp_strategy=vanilla",)),
    "btp_tp": System("BOOST BTP, SVD low-rank r=d/4 (tp=2)", 2, TP2 + LOW_RANK + ("model.tp_strategy=btp",)),
    "three_tiers": System("three tiers dp=2 x tp=2 x pp=2 (issue 17)", 8, (), config=THREE_TIERS),
    # the same job as a plain 3D layout: full rank, Megatron TP, uncompressed stage link, DP all-reduce every step
    "dense_3d": System("uncompressed 3D dp=2 x tp=2 x pp=2 (Megatron, identity, all-reduce)", 8, DENSE_3D,
                       config=THREE_TIERS),
    # issue 45's like-for-like compositions: every row the same dp=2 x tp=2 x pp=2 job (the three-tier file), with
    # nothing compressed (dense_3d), one tier compressed, two, or all three (three_tiers), and dense DiLoCo
    **{name: System(label, 8, keys, config=THREE_TIERS) for name, label, keys in [
        ("3d_sm", "3D, pipeline: SM k=d/8", DENSE_3D + tuple(SM)),
        ("3d_resbm", "3D, pipeline: ResBM 128x", DENSE_3D + ("model.codec.kind=resbm", "model.codec.resbm.h=1")),
        ("3d_mapl", "3D, pipeline: MAPL", DENSE_3D + ("model.codec.kind=mapl",)),
        ("3d_int4", "3D, pipeline: lossy int4", DENSE_3D + ("model.codec.kind=int4",)),
        ("3d_btp", "3D, TP: BOOST BTP (SVD r=d/4)", ALLREDUCE),
        ("3d_sparseloco", "3D, DP: SparseLoCo", DENSE_TP + ("sparseloco.compressed_replicas=[]",)),
        ("3d_sm_sparseloco", "3D, pipeline + DP: heterogeneous SparseLoCo (SM on replica 0), dense Megatron TP",
         DENSE_TP),
        ("3d_btp_sm", "3D, TP + pipeline: BTP + SM", ALLREDUCE + tuple(SM)),
        ("3d_btp_sparseloco", "3D, TP + DP: BTP + SparseLoCo", ("sparseloco.compressed_replicas=[]",)),
        ("3d_diloco", "3D, DP: dense periodic averaging (SparseLoCo's outer loop, every entry sent in bf16, outer SGD "
         "lr 1, no momentum)", DENSE_TP + DENSE_OUTER),
        # DiLoCo's own outer step (arXiv:2311.08105: Nesterov momentum 0.9, outer lr 0.7) on the same dense sync
        ("3d_diloco_nesterov", "3D, DP: dense DiLoCo (outer Nesterov, lr 0.7, momentum 0.9; every entry in bf16)",
         DENSE_TP + DENSE_OUTER + DILOCO_OUTER),
        # the same two with the streaming outer sync (sparseloco.streaming, arXiv:2501.18512: the all_gather behind
        # tau = 1 inner step, merged with alpha 0.5): the baseline gets the overlap its best user would use
        ("3d_btp_sparseloco_streaming", "3D, TP + DP: BTP + SparseLoCo, streaming outer sync (tau = 1, alpha = 0.5)",
         ("sparseloco.compressed_replicas=[]", STREAMING)),
        ("3d_diloco_nesterov_streaming", "3D, DP: dense DiLoCo (outer Nesterov), streaming outer sync (tau = 1, "
         "alpha = 0.5)", DENSE_TP + DENSE_OUTER + DILOCO_OUTER + (STREAMING,)),
        # the composed job itself with it (streaming with heterogeneous replicas: the fold on arrival); no runs yet
        ("three_tiers_streaming", "three tiers, streaming outer sync (tau = 1, alpha = 0.5)", (STREAMING,)),
    ]},
    # the churn scenario: 4 replicas, one of them absent from 1 outer sync in 5 (sparseloco.churn), beside no churn
    "sparseloco_dp4": System("SparseLoCo (dp=4)", 4, DATA4 + ("parallelism.dp_sync=sparseloco",)),
    "sparseloco_dp4_churn": System("SparseLoCo (dp=4), one replica down 20% of syncs", 4,
                                   DATA4 + ("parallelism.dp_sync=sparseloco", "sparseloco.churn.down_syncs=1",
                                            "sparseloco.churn.period=5")),
}
DEFAULT_SYSTEMS = ["pipeline", "subspace_pipeline", "ddp", "sparseloco"]


def uses_outer_loop(s: System) -> bool:
    """Whether a system's replicas sync by SparseLoCo's outer loop (its keys, or its own YAML unless overridden)."""
    if "parallelism.dp_sync=sparseloco" in s.overrides:
        return True
    return s.config == THREE_TIERS and "parallelism.dp_sync=allreduce" not in s.overrides


def shared_warmup(args: argparse.Namespace) -> int:
    """The warm-up steps of --config (what the systems built on it train with)."""
    from nanotron_ext.config import load_config

    return load_config(config_file("--config", args.config, REPO), []).optimizer.warmup_steps


def system_config(system: str, args: argparse.Namespace) -> Path:
    """The YAML a system's runs start from: its own file of the checkout, else --config (found from any folder)."""
    s = SYSTEMS[system]
    return REPO / s.config if s.config else config_file("--config", args.config, REPO)


# the keys one run sets live beside the systems they read (losses.py and runs.py both ask; in runs.py they tied
# losses -> runs -> compute_check -> profile -> losses into a loop)
def run_overrides(system: str, preset: Optional[str], seed: int, args: argparse.Namespace) -> List[str]:
    """The keys one run sets: the system's, the link preset on every tier (none without `preset`: the model
    clock's loss runs), the budget and the seed."""
    s = SYSTEMS[system]
    if preset is None:
        link = []
    elif preset in ANCHORS:  # a calibrated preset: each tier scaled to this machine (bench/wan/presets.py)
        link = tier_links(preset, getattr(args, "anchor_links", {}).get(preset), args.tp_preset)
    else:
        link = ["parallelism.link.enabled=true", f"parallelism.link.preset={preset}",
                f"parallelism.link.dp.preset={preset}", f"parallelism.link.tp.preset={args.tp_preset}"]
    # the same budget for every system, also those with their own YAML (the three-tier file's own 30 steps and 5
    # warm-up steps gave way to --steps and the shared config's warm-up)
    budget = [f"tokens.train_steps={args.steps}", f"tokens.val_check_interval={args.val_every}"]
    if s.config:
        budget.append(f"optimizer.warmup_steps={shared_warmup(args)}")
    if uses_outer_loop(s):
        budget.append(f"sparseloco.inner_steps={args.inner_steps}")
    return [*s.overrides, *link, *budget, f"general.seed={seed}", "logging.progress_bar=false", *args.set]
