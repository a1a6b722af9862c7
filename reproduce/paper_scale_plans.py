"""The planned configs behind reproduce/results/PAPER_SCALE.md: which layout stands for each paper row, and its plan.

A plan is what the model clock prices (nanotron_ext/bench/clock/pricing.py: per rank the FLOPs of one step and the
comm ledger's bytes and calls). A run that reproduce/plan_table.py plans too (the same config and overrides) is read
from reproduce/results/PLAN.json, so the table follows that file when it is regenerated; the others are planned
here with the planner (one planner at a time; it runs a pipeline's stages side by side) and cached in
reproduce/results/plans/ under the hash of the part of their config a plan depends on (nanotron_ext.plan.cache_key),
so a rerun plans only what changed and a key added elsewhere (checkpoints, logging) replans nothing.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from reproduce.plan_table import RESBM_TABLE3  # noqa: E402
from reproduce.plan_table import RUNS as PLAN_RUNS  # noqa: E402

CACHE = REPO / "reproduce" / "results" / "plans"
PLAN_JSON = REPO / "reproduce" / "results" / "PLAN.json"
# BOOST Table 3 times one CoLA 7B decoder block (TP 4, BTP): the planner plans whole models, so a block is the
# difference between a two-layer and a one-layer model (embedding, head and their collectives cancel), with a
# 512-token vocabulary to keep the cancelled parts small
BLOCK = ["model.vocab_size=512", "tokenizer.vocab_size=512"]
B7 = "reproduce/boost/llama_7b_{}.yaml"
RUNS: Dict[str, Tuple[str, List[str]]] = {
    **{name: PLAN_RUNS[name] for name in (
        "resbm_2b_baseline_pp8", "resbm_2b_128x_adamw_pp8", "sm_2b_centralised", "sm_2b_decentralised",
        "sm_2b_compressed", *(f"llama_{s}_{k}" for s in ("1b", "3b", "7b", "13b", "30b")
                              for k in ("fullrank", "vanilla", "btp")))},
    **{f"resbm_2b_{v}_pp8": (f"reproduce/resbm/resbm_2b_{v}.yaml", RESBM_TABLE3)
       for v in ("100x_adamw", "100x_muon", "128x_muon")},
    "protocolnanogpt_dense": ("reproduce/sm/protocolnanogpt_dense.yaml", []),
    "protocolnanogpt_ssn": ("reproduce/sm/protocolnanogpt_ssn.yaml", []),
    **{f"boost_block{n}_{g}_bz{b}": (B7.format("btp"), [*BLOCK, f"model.num_layers={n}",
                                                        f"model.boost.group_linears={str(g == 'grouped').lower()}",
                                                        f"tokens.micro_batch_size={b}"])
       for n in (1, 2) for g in ("ungrouped", "grouped") for b in (1, 4)},
    **{f"llama_7b_{k}_bz{b}": (B7.format(k), [f"tokens.micro_batch_size={b}"])
       for k in ("fullrank", "btp") for b in (1, 2)},
    **{f"llama_7b_{k}_{lr}": (B7.format(k), [f"model.low_rank.kind={lr}"])
       for k in ("vanilla", "btp") for lr in ("svd", "lax")},
    # heterogeneous SparseLoCo's 512M, half the replicas compressed at 1/8 (plan_table's HET_HALF), planned as an
    # inner and an outer step (the clock amortises the outer sync over H steps)
    "sparseloco_512m_het_half": PLAN_RUNS["sparseloco_512m_het_half"],
}


def _from_plan_json(run: Dict[str, Any]) -> Dict[str, Any]:
    """PLAN.json's run (one planned rank per stage of each distinct replica) in profile.planned's form. Only for
    DP syncs without an outer loop: PLAN.json plans the step a DP sync's outer loop takes, not an inner one."""
    lay = run["layout"]
    if lay["dp"] != 1:
        raise ValueError("PLAN.json's runs are read back here only at dp = 1")
    tokens_per_micro = run["tokens_per_replica_step"]  # replaced below by the config's micro-batches
    ranks = sorted(run["ranks"], key=lambda r: r["rank"])
    return {"layout": {"dp": 1, "tp": lay["tp"], "pp": lay["pp"]}, "micro_batches": tokens_per_micro,
            "schedule": lay["pp_engine"], "outer_every": 0, "replica_of": {"0": 0}, "inner": [ranks], "outer": None}


def _saved_runs() -> Dict[str, Any]:
    """PLAN.json's runs, checked (nanotron_ext.plan.cached.read_plan_table); a damaged file is refused by name, exit
    2: it is committed, so restore or regenerate it rather than plan around it."""
    from nanotron_ext.cli_checks import ArgumentError, refuse
    from nanotron_ext.plan.cached import read_plan_table

    if not PLAN_JSON.exists():
        return {}
    try:
        return read_plan_table(PLAN_JSON)["runs"]
    except ArgumentError as e:
        refuse(e)


def plan_of(name: str) -> Dict[str, Any]:
    """The plan of RUNS[name] (module docstring) with "tokens_per_step" (every replica) and "source"."""
    from nanotron_ext.bench.clock import plan_path, planned
    from nanotron_ext.config.loader import load_config

    config, overrides = RUNS[name]
    cfg = load_config(REPO / config, list(overrides))
    t = cfg.tokens
    tokens = t.sequence_length * t.micro_batch_size * t.batch_accumulation_per_replica * cfg.parallelism.dp
    saved = _saved_runs() if PLAN_RUNS.get(name) == RUNS[name] else {}
    if name in saved and cfg.parallelism.dp == 1:
        plan = _from_plan_json(saved[name])
        plan["micro_batches"] = t.batch_accumulation_per_replica
        source = "reproduce/results/PLAN.json"
    else:
        plan = planned(str(REPO / config), list(overrides), CACHE)
        source = f"reproduce/results/plans/{plan_path(cfg, CACHE).name}"
    return {**plan, "tokens_per_step": tokens, "source": source}


def _tracked(folder: Path) -> Optional[Set[str]]:
    """Names of the files git tracks in `folder`, or None where git cannot say (no checkout, no git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=folder, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {Path(line).name for line in out.stdout.decode().split("\0") if line}


def prune(used: Set[str], cache: Path = CACHE) -> List[str]:
    """Remove the cached plans no run reads any more (a config or the planner changed: the old plan is orphaned);
    their names. Nothing is removed unless every plan in `used` is there (a cache key computed otherwise than
    profile.planned's would otherwise empty the folder), and never a plan git tracks (a committed plan goes with a
    commit that says why, not as a side effect of a run), nor any where git cannot say which are tracked."""
    rel = cache.relative_to(REPO).as_posix() if cache.is_relative_to(REPO) else str(cache)
    cached = sorted(cache.glob("plan_*.json"))
    names = {f"{rel}/{p.name}" for p in cached}
    if any(u.startswith(f"{rel}/") and u not in names for u in used):
        return []
    tracked = _tracked(cache)
    if tracked is None:
        return []
    gone = [p for p in cached if f"{rel}/{p.name}" not in used and p.name not in tracked]
    for p in gone:
        p.unlink()
    return [p.name for p in gone]
