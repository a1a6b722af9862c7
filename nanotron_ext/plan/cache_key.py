"""Which part of a resolved config a plan depends on: the key of the model clock's plan cache
(nanotron_ext.bench.clock.planned) hashes this part only, so a key added to a section the planner never reads
(checkpoints.storage, logging.rank_cpu_seconds) does not orphan every cached and committed plan.

The rule, an allow-list by section: a plan (per rank the FLOPs, memory and comm ledger of one step on the meta
device, nanotron_ext.plan.rank) is what the step's code does with

- `model` (every key: the layers, widths, codec, embedding, TP strategy, dtype, and the technique sections mounted
  under it, which the core's builders read too);
- the batch shape: `tokens` less its run-length keys (train_steps, val_check_interval, val_steps: the planner steps
  two iterations and never validates) and `tokenizer.vocab_size`;
- the layout: `parallelism` less `parallelism.link` (the planner runs over torch's fake process group with no
  emulated link; links are priced by the clock afterwards, never planned);
- `optimizer` (every key: Muon's Newton-Schulz matmuls are FLOPs, MAPL's SPEL optimiser is under it);
- the step guard, whose agreements are in the ledger: `general.step_guard`, `general.max_loss_ratio`,
  `general.max_weight_growth` (0 turns a test off);
- a technique's sections mounted outside those (SparseLoCo's `sparseloco`) while the technique is in use: it
  provides the config's choice at one of its keys (`parallelism.dp_sync: sparseloco`) or one in use requires it.
  The core never reads them otherwise.

Why an allow-list of sections and not a deny-list of keys: the two fail differently. A key missing from a
deny-list costs a needless replan and orphans the committed plans (issue 53: 22 plans, 915 s); a key missing from
an allow-list would reuse a stale plan silently. Allowing whole sections that the step reads keeps the safe
default where keys are added most (a new model, parallelism or technique key counts at once), while the sections
the step never reads (general's run naming, data, checkpoints, logging) change nothing.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Set

# dotted paths of the resolved config that define a plan, and the paths inside them that do not (module docstring)
PLAN_DEFINING = ("model", "tokens", "tokenizer.vocab_size", "parallelism", "optimizer", "general.step_guard",
                 "general.max_loss_ratio", "general.max_weight_growth")
NOT_PLAN_DEFINING = ("tokens.train_steps", "tokens.val_check_interval", "tokens.val_steps", "parallelism.link")


def _lookup(tree: Dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _drop(tree: Dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    if isinstance(tree, dict):
        tree.pop(last, None)


def techniques_in_use(resolved: Dict[str, Any]) -> Set[str]:
    """Names of the registered techniques a resolved config uses: each that provides the config's value at one of
    its keys, and those they require."""
    from nanotron_ext.registry import techniques

    every = {t.name: t for t in techniques()}
    used = {t.name for t in every.values()
            if any(_lookup(resolved, key) in names for key, names in t.provides.items())}
    pending = list(used)
    while pending:
        for name in every[pending.pop()].requires:
            if name in every and name not in used:
                used.add(name)
                pending.append(name)
    return used


def plan_defining(resolved: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a resolved config (config_to_dict's form) a plan depends on (module docstring), by dotted path."""
    from nanotron_ext.registry import techniques

    tree = copy.deepcopy(resolved)
    for path in NOT_PLAN_DEFINING:
        _drop(tree, path)
    paths: List[str] = list(PLAN_DEFINING)
    used = techniques_in_use(resolved)
    for technique in techniques():
        for mount in technique.sections:
            inside = any(mount == p or mount.startswith(p + ".") for p in PLAN_DEFINING)
            if not inside and technique.name in used:
                paths.append(mount)
    return {path: _lookup(tree, path) for path in sorted(set(paths))}
