"""The model clock's plan cache (nanotron_ext.plan.cache_key, bench/clock/pricing.plan_path) and the paper-scale
table's committed plans (reproduce/paper_scale_plans.py): the key follows only what changes a plan, the committed
plans are the ones the table reads, and pruning never deletes a committed plan."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from nanotron_ext.bench.clock import plan_path
from nanotron_ext.config.digest import digest
from nanotron_ext.config.loader import config_to_dict, load_config
from nanotron_ext.plan.cache_key import plan_defining, techniques_in_use

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "config_tiny_llama.yaml")
SPARSELOCO = str(REPO / "examples" / "config_tiny_sparseloco.yaml")
sys.path.insert(0, str(REPO))


def _name(config: str, sets: List[str]) -> str:
    return plan_path(load_config(config, sets), Path("cache")).name


@pytest.mark.parametrize("inert", ["checkpoints.storage=per_host", "logging.rank_cpu_seconds=true",
                                   "general.run=another_name", "general.output_dir=elsewhere", "general.seed=7",
                                   "data.prepared_dir=other_data", "tokenizer.path=other/tokenizer.json",
                                   "tokens.train_steps=12345", "logging.nvtx=false",
                                   "parallelism.link.enabled=true", "checkpoints.interval=3"])
def test_a_key_the_planner_never_reads_leaves_the_plan_key(inert: str) -> None:
    assert _name(TINY, [inert]) == _name(TINY, [])


@pytest.mark.parametrize("config, changed", [
    (TINY, "model.hidden_size=192"), (TINY, "model.num_layers=3"), (TINY, "tokens.micro_batch_size=3"),
    (TINY, "tokens.sequence_length=96"), (TINY, "parallelism.dp=1"), (TINY, "optimizer.name=muon"),
    (TINY, "general.step_guard=host"), (TINY, "model.codec.kind=int8 model.codec.boundaries=every_layer"),
    (SPARSELOCO, "sparseloco.topk=7"),
    (SPARSELOCO, "sparseloco.inner_steps=3")])
def test_a_key_that_changes_the_step_changes_the_plan_key(config: str, changed: str) -> None:
    assert _name(config, changed.split(" ")) != _name(config, [])


def test_a_technique_section_counts_only_while_the_technique_is_in_use() -> None:
    """SparseLoCo's section changes nothing of an all-reduce config's step (the core never reads it)."""
    assert "sparseloco" not in techniques_in_use(config_to_dict(load_config(TINY, [])))
    assert {"sparseloco", "subspace"} <= techniques_in_use(config_to_dict(load_config(SPARSELOCO, [])))
    resolved = config_to_dict(load_config(TINY, []))
    grown = copy.deepcopy(resolved)
    grown["sparseloco"]["topk"] = 7  # (a config that sets it is refused at load: the all-reduce sync ignores it)
    assert digest(plan_defining(grown), 16) == digest(plan_defining(resolved), 16)


def test_a_key_added_later_counts_in_a_plan_section_and_not_elsewhere() -> None:
    """The rule is an allow-list by section: a key a later change adds to checkpoints or logging keeps every cached
    plan (issue 53: two such keys orphaned all 22 committed plans), one added to model changes the key."""
    resolved = config_to_dict(load_config(TINY, []))
    base = digest(plan_defining(resolved), 16)
    for section, inert in (("checkpoints", True), ("logging", True), ("data", True), ("general", True),
                           ("model", False), ("optimizer", False), ("parallelism", False), ("tokens", False)):
        grown = copy.deepcopy(resolved)
        grown[section]["a_key_added_later"] = 1
        assert (digest(plan_defining(grown), 16) == base) == inert, section


def test_every_committed_plan_is_one_the_paper_table_reads_and_every_read_one_is_committed() -> None:
    """`python reproduce/paper_scale.py` replans nothing on a fresh checkout: each run it reads from the cache has
    its plan committed under the key computed today."""
    from reproduce import paper_scale_plans as psp

    saved = psp._saved_runs()
    read = set()
    for name, (config, sets) in psp.RUNS.items():
        cfg = load_config(REPO / config, list(sets))
        if not (psp.PLAN_RUNS.get(name) == psp.RUNS[name] and name in saved and cfg.parallelism.dp == 1):
            read.add(plan_path(cfg, psp.CACHE).name)
    tracked = subprocess.run(["git", "ls-files", "--", "reproduce/results/plans"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert read == {Path(t).name for t in tracked}


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=folder, check=True,
                   capture_output=True)


def test_prune_removes_an_orphaned_plan_but_never_a_committed_one(tmp_path: Path) -> None:
    from reproduce.paper_scale_plans import prune

    cache = tmp_path / "plans"
    cache.mkdir()
    for name in ("plan_committed.json", "plan_used.json", "plan_orphan.json"):
        (cache / name).write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "plans/plan_committed.json")
    _git(tmp_path, "commit", "-q", "-m", "a committed plan")
    assert prune({f"{cache}/plan_used.json"}, cache) == ["plan_orphan.json"]
    assert sorted(p.name for p in cache.iterdir()) == ["plan_committed.json", "plan_used.json"]


def test_prune_removes_nothing_where_git_cannot_say_what_is_committed(tmp_path: Path) -> None:
    from reproduce.paper_scale_plans import prune

    cache = tmp_path / "plans"
    cache.mkdir()
    (cache / "plan_orphan.json").write_text("{}\n")
    assert prune(set(), cache) == [] and (cache / "plan_orphan.json").exists()
