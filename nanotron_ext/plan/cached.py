"""A cached plan read back (nanotron_ext.bench.clock.planned): checked against the form the planner writes and the
config it stands for before the clock prices it, so a damaged, hand-edited or NaN-holding file is planned again
with one line on stderr instead of a traceback or a table of `nan`."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from nanotron_ext.cli_checks import JsonFile
from nanotron_ext.errors import UserFacingError

MAX_PLAN_BYTES = 64 * 2**20  # the largest committed plan is ~100 KB; a plan lists a few ranks' ledgers


class DamagedPlan(UserFacingError):
    """A cached plan that is not what the planner writes."""


def first_non_finite(value: Any, where: str = "") -> Optional[str]:
    """The first NaN or infinity in a parsed JSON value (json.loads takes NaN and Infinity), as "where = value"
    ("runs.r.ranks.0.flops is nan"), or None: no script here writes one on purpose, so one read back is damage."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the value'} is {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_non_finite(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def check_rank(f: JsonFile, rank: Mapping[str, Any], where: str) -> None:
    """One planned rank (nanotron_ext.plan.rank.plan_rank's record) as the clock reads it: flops and ledger."""
    f.number(rank, "flops", where, low=0)
    ledger = f.table(rank, "ledger", dict, where)
    for group, ops in ledger.items():
        for op, counts in ops.items():
            at = f"{where}.ledger.{group}.{op}"
            if not isinstance(counts, dict):
                f.fail(f"{at} is not an object")
            f.number(counts, "bytes", at, low=0)
            f.number(counts, "calls", at, low=0)


def _check_columns(f: JsonFile, plan: Mapping[str, Any], key: str, pp: int) -> int:
    columns = f.need(plan, key, list)
    if not columns:
        f.fail(f"{key} is empty")
    for i, column in enumerate(columns):
        if not isinstance(column, list) or len(column) != pp:
            f.fail(f"{key}[{i}] is not a list of {pp} stage plans")
        for s, rank in enumerate(column):
            if not isinstance(rank, dict):
                f.fail(f"{key}[{i}][{s}] is not an object")
            check_rank(f, rank, f"{key}[{i}][{s}]")
    return len(columns)


def check_plan(f: JsonFile, layout: Mapping[str, int]) -> Dict[str, Any]:
    """The plan in `f`, refused (f.error) unless it has the planner's form for `layout` ({"dp", "tp", "pp"} of the
    config it is cached for) and holds finite numbers only."""
    plan = f.read_object()
    bad = first_non_finite(plan, "")
    if bad:
        f.fail(f"{bad}, not a finite number")
    lay = f.table(plan, "layout", int)
    if {k: lay.get(k) for k in ("dp", "tp", "pp")} != dict(layout):
        f.fail(f"layout is {lay}, not the config's {dict(layout)}")
    f.number(plan, "micro_batches", low=1)
    f.need(plan, "schedule", str)
    every = f.number(plan, "outer_every", low=0)
    columns = _check_columns(f, plan, "inner", layout["pp"])
    if (plan.get("outer") is None) != (every == 0):
        f.fail(f"outer is {'missing' if plan.get('outer') is None else 'present'} with outer_every {every:g}")
    if plan.get("outer") is not None and _check_columns(f, plan, "outer", layout["pp"]) != columns:
        f.fail("outer has not one column per inner column")
    replica_of = f.table(plan, "replica_of", int)
    if sorted(replica_of) != sorted(str(r) for r in range(layout["dp"])) or \
            any(not 0 <= i < columns for i in replica_of.values()):
        f.fail(f"replica_of does not map each dp rank 0..{layout['dp'] - 1} to one of the {columns} planned columns")
    return plan


def read_cached_plan(path: Path, layout: Mapping[str, int]) -> Optional[Dict[str, Any]]:
    """The plan cached at `path` (check_plan), or None when there is none or it is damaged: then one line on
    stderr says which file and why, and the caller plans again (writing over it)."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return check_plan(JsonFile(path, "plan cache", DamagedPlan, "planning it again", MAX_PLAN_BYTES), layout)
    except DamagedPlan as e:
        print(e, file=sys.stderr)
        return None


def read_plan_table(path: Path) -> Dict[str, Any]:
    """A saved table of plans (reproduce/results/PLAN.json: {"runs": {name: python -m nanotron_ext.plan's summary}}),
    every run checked as the model clock reads it (layout, per rank finite FLOPs and ledger); a damaged one is
    refused by name (cli_checks.ArgumentError): it is committed, so restore or regenerate it rather than plan around
    it."""
    f = JsonFile(path, "the plan table", advice="restore it (git checkout -- reproduce/results/PLAN.json) or "
                 "regenerate it (python reproduce/plan_table.py)")
    saved = f.read_object()
    runs = f.table(saved, "runs", dict)
    bad = first_non_finite(runs, "runs")
    if bad:
        f.fail(f"{bad}, not a finite number")
    for name, run in runs.items():
        where = f"runs.{name}"
        layout = f.need(run, "layout", dict, where)
        for key in ("dp", "tp", "pp"):
            f.number(layout, key, f"{where}.layout", low=1)
        f.need(layout, "pp_engine", str, f"{where}.layout")
        for i, rank in enumerate(f.need(run, "ranks", list, where)):
            if not isinstance(rank, dict):
                f.fail(f"{where}.ranks[{i}] is not an object")
            check_rank(f, rank, f"{where}.ranks[{i}]")
    return saved

