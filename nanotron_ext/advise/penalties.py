"""Steps to target per system: where the losses come from.

A system's time to target is its steps to the target times its step. Steps come from loss runs, never from the clock,
one set at a time (each has its own target, so sets are never mixed):
- `model_clock` (the default): `reproduce/wan/results/model_clock.json`, d = 128, 1,000 steps, 3 seeds (the
  equal-token rows, and the equal-time rows for the systems that needed longer to reach the target), with the
  streaming systems' runs of `model_clock_streaming.json` (the same model, data, budget and H, trained later): their
  curves read against model_clock.json's own target (dense's final loss x 1.02), never their file's;
- a size of `reproduce/wan/results/loss_scales.json` (the WAN meter's loss runs at more than one model size: each
  system's steps to dense's final loss x 1.02 at that size, its penalty = those steps / dense's);
- `papers=True`: the papers' published loss gaps at their scale (`PAPER_LOSSES`; loss_scales.json lists them all)
  turned into step multiples by Chinchilla's data term (the second map), dense = 1.
A system no run brought to the target has only a lower bound (the run's length / dense's steps): it is ranked at
that bound, which favours it, and marked so.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.errors import UserFacingError

REPO = Path(__file__).resolve().parents[2]
SCALES = REPO / "reproduce" / "wan" / "results" / "loss_scales.json"
MODEL_CLOCK = REPO / "reproduce" / "wan" / "results" / "model_clock.json"
MORE_RUNS = tuple(REPO / "reproduce" / "wan" / "results" / f"model_clock_streaming{part}.json"  # the same set's
                  for part in ("", "_three_tiers"))  # later runs
SAME_SET = ("steps", "val_every", "inner_steps", "config", "set")  # what a later file must share with model_clock's
DENSE = "dense_3d"


@dataclasses.dataclass(frozen=True)
class Steps:
    """A system's steps to target relative to dense (`penalty`), dense's own steps, and where they come from."""

    penalty: float
    dense_steps: float
    source: str
    lower_bound: bool = False  # not reached: `penalty` is at least this


def _mean(xs: Any) -> Optional[float]:
    vals = [x for x in (xs or []) if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


def from_model_clock(path: Path = MODEL_CLOCK, more: Sequence[Path] = MORE_RUNS) -> Dict[str, Steps]:
    """d = 128's penalties from the committed model clock (one preset's rows: losses do not depend on links), and
    those of the systems `more` adds (later runs of the same set, read against this file's target)."""
    saved = json.loads(path.read_text())
    rows = saved["rows"]
    preset = rows[0]["preset"]
    rows = [r for r in rows if r["preset"] == preset]
    dense = next(r for r in rows if r["system"] == DENSE and r.get("budget", "tokens") == "tokens")
    d_steps = dense["steps_to_target"][0]
    budget = max(step for step, _ in dense["curves"][0])
    out: Dict[str, Steps] = {}
    for r in sorted(rows, key=lambda r: r.get("budget", "tokens") == "time"):  # an equal-time row wins
        reached, runs = (int(x) for x in r["reached"].split("/"))
        src = f"our loss runs, d = 128 ({r.get('budget', 'tokens')} budget, {r['reached']} seeds reached)"
        if reached == runs and r["steps_to_target"][0]:
            out[r["system"]] = Steps(r["steps_to_target"][0] / d_steps, d_steps, src)
        elif r["system"] not in out or out[r["system"]].lower_bound:
            steps = r.get("budget_steps", budget)
            out[r["system"]] = Steps(steps / d_steps, d_steps, src + f": not reached by all in {steps} steps",
                                     lower_bound=True)
    for extra in (p for p in more if p.exists()):
        out.update(later_runs(extra, saved["meta"], dense["target_val_loss"], d_steps))
    return out


def later_runs(path: Path, meta: Dict[str, Any], target: float, d_steps: float) -> Dict[str, Steps]:
    """Penalties of the systems a later meter result trained (its runs' curves against `target`, the model clock's),
    refused naming the file where its budget, H or config is not the model clock's (a different set of runs)."""
    from nanotron_ext.bench.wan.model_results import steps_to_target

    saved = json.loads(path.read_text())
    differs = next((k for k in SAME_SET if saved.get("meta", {}).get(k) != meta.get(k)), None)
    if differs is not None:
        raise UserFacingError(f"{path}: meta.{differs} is {saved['meta'].get(differs)!r}, model_clock.json's "
                              f"{meta.get(differs)!r}: not the same set of loss runs, so not read with it")
    by_system: Dict[str, List[Any]] = {}
    for run in saved["runs"]:
        by_system.setdefault(run["system"], []).append(steps_to_target(run["val_curve"], target))
    out = {}
    for system, hits in by_system.items():
        reached = [h for h in hits if h is not None]
        src = (f"our loss runs, d = 128 ({path.name}, tokens budget, {len(reached)}/{len(hits)} seeds reached "
               f"model_clock.json's target {target:.3f})")
        if len(reached) == len(hits):
            out[system] = Steps(sum(reached) / len(reached) / d_steps, d_steps, src)
        else:
            steps = saved["meta"]["steps"]
            out[system] = Steps(steps / d_steps, d_steps, src + f": not reached by all in {steps} steps", True)
    return out


def from_scales(path: Path = SCALES, size: Optional[str] = None) -> Dict[str, Steps]:
    """Penalties from loss_scales.json: per system, the largest size (or `size`) whose runs all reached it."""
    sizes = sorted(json.loads(path.read_text())["sizes"], key=lambda s: s["non_embedding_params"])
    out: Dict[str, Steps] = {}
    for s in sizes:
        if size and s["name"] != size:
            continue
        dense = _mean(s["systems"].get(DENSE, {}).get("steps_to_target"))
        if dense is None:
            continue
        for name, row in s["systems"].items():
            reached, runs = (int(x) for x in str(row.get("reached", "0/1")).split("/"))
            mean = _mean(row.get("steps_to_target"))
            src = f"our loss runs, {s['name']} ({row.get('reached')} seeds reached)"
            if reached == runs and mean is not None:
                out[name] = Steps(mean / dense, dense, src)
            elif name not in out:
                out[name] = Steps(s["steps"] / dense, dense, src + f": not reached in {s['steps']} steps", True)
    return out


# The papers' losses the second map converts (loss_scales.json lists every published number; these are the ones at
# the map's scale for its systems): (paper and table, dense-side loss, system loss, tokens). No paper composes all
# three tiers, trains BTP's loss against full rank, or is DiLoCo's own among the given papers: those stay unranked.
PAPER_LOSSES = {
    "3d_sm_sparseloco": ("Heterogeneous SparseLoCo (arXiv:2601.02360) Table 1, 512M, Het-PP-Compress (1/2) 87.5% vs "
                         "its SparseLoCo baseline", 2.73, 2.82, 10e9),
    "3d_sparseloco": ("Heterogeneous SparseLoCo Tables 1 and 3, 512M: SparseLoCo vs per-step AdamW", 2.75, 2.73, 10e9),
    "3d_sm": ("Protocol Models (arXiv:2506.01260) Table 2, 640M on C4: compressed vs centralised perplexity 12.53 / "
              "12.61 (MAPL's table, arXiv:2606.05484, reads SM 6x at 500M 0.28 nats behind instead)",
              math.log(12.61), math.log(12.53), 12e9),
}
# Chinchilla's data term (Hoffmann et al. 2022, arXiv:2203.15556, approach 3: L = E + A / N^0.34 + B / D^0.28,
# B = 410.7): a run that ends dL above dense at D tokens needs k D tokens with B / (k D)^b = B / D^b - dL
CHINCHILLA_B, CHINCHILLA_BETA = 410.7, 0.28


def tokens_factor(d_loss: float, tokens: float) -> float:
    """The token (= step) multiple a loss gap `d_loss` at `tokens` costs on Chinchilla's data term (inf: never)."""
    if d_loss <= 0:
        return 1.0
    left = 1.0 - d_loss * tokens ** CHINCHILLA_BETA / CHINCHILLA_B
    return math.inf if left <= 0 else left ** (-1.0 / CHINCHILLA_BETA)


def from_papers() -> Dict[str, Steps]:
    """The second map's steps: each system's published loss gap at its paper's scale turned into a step multiple
    by Chinchilla's data term (a published loss at equal tokens is how far behind a run ends, not how many more steps
    it needs: the conversion is this project's, stated); dense = 1."""
    # dense's own steps (hours need one): our d = 128 runs', the same as the first map's
    steps = from_model_clock()[DENSE].dense_steps if MODEL_CLOCK.exists() else 1.0
    out: Dict[str, Steps] = {DENSE: Steps(1.0, steps, "dense: the reference")}
    for system, (where, dense, loss, tokens) in PAPER_LOSSES.items():
        k = tokens_factor(loss - dense, tokens)
        if math.isfinite(k):
            out[system] = Steps(k, steps, f"{where}: {loss:g} vs {dense:g} at {tokens:.3g} tokens, x{k:.2f} the "
                                          "tokens on Chinchilla's data term")
    return out


def sources() -> List[str]:
    """The loss-run sets steps can come from: `model_clock` (d = 128, the committed model clock's runs), each size of
    loss_scales.json, and `papers`."""
    sizes = [s["name"] for s in json.loads(SCALES.read_text())["sizes"]] if SCALES.exists() else []
    return ["model_clock", *sizes, "papers"]


def penalties(source: str = "model_clock") -> Dict[str, Steps]:
    """The steps to target of one loss-run set (`sources()`): never mixed, since each set has its own target."""
    if source == "papers":
        return from_papers()
    if source == "model_clock":
        return from_model_clock()
    return from_scales(size=source)
