"""What the meter makes of the model clock (`--clock model`): per (preset, system) the replayed step's two bounds,
the learning curves' steps to the target, their product (time to target on the clock), the headline and the figure.

Time to target = (the first validated step at or below the target, per seed) x the clock's step time, for each
bound; the target is the reference system's final validation loss (mean over seeds) x (1 + target_rel). Loss at
equal time: each seed's last validation by the reference's modelled time to target (a system whose whole budget
ends sooner keeps its final loss: this is the equal-token budget read at one time, not an equal-time run with its
own schedule).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench.paper import mean_se
from nanotron_ext.bench.report import fmt_bytes, grouped_bars, new_figure

TIERS = ("tp", "pp", "dp")
BOUNDS = ("lower", "upper")
# which tiers each like-for-like row compresses (issue 45 item 6); the rest are not ranked in the headline
COMPRESSED_TIERS: Dict[str, Tuple[str, ...]] = {
    "dense_3d": (), "3d_sm": ("pp",), "3d_resbm": ("pp",), "3d_mapl": ("pp",), "3d_int4": ("pp",),
    "3d_btp": ("tp",), "3d_sparseloco": ("dp",), "3d_sm_sparseloco": ("pp", "dp"), "3d_btp_sm": ("tp", "pp"),
    "3d_btp_sparseloco": ("tp", "dp"), "three_tiers": ("tp", "pp", "dp"),
}
DENSE, DILOCO = "dense_3d", "3d_diloco"
GOALS = {"dense 3D": 3.0, "best single-tier": 1.3, "dense DiLoCo": 1.3}


def steps_to_target(curve: Sequence[Sequence[float]], target: float) -> Optional[float]:
    """The first validated step at or below `target` (None: not reached)."""
    return next((step for step, loss in curve if loss <= target), None)


def loss_at_step(curve: Sequence[Sequence[float]], step: float) -> Optional[float]:
    """The last validation at or before `step`; the final one when the run ended sooner."""
    seen = [loss for s, loss in curve if s <= step]
    return seen[-1] if seen else None


def pooled_rows(curves: Sequence[Mapping[str, Any]], clocks: Mapping[Tuple[str, str], Mapping[str, Any]],
                reference: str, target_rel: float, target: Optional[float] = None) -> List[Dict[str, Any]]:
    """One row per (preset, system): `curves` the loss runs (system, seed, val_curve, final_val_loss), `clocks`
    {(preset, system): {"lower_s", "upper_s", "bytes_per_step", "closed_form_bytes_per_step", "tokens_per_step"}};
    the target is the reference's final loss x (1 + target_rel) unless given."""
    by_system: Dict[str, List[Mapping[str, Any]]] = {}
    for c in curves:
        by_system.setdefault(c["system"], []).append(c)
    ref = [c["final_val_loss"] for c in by_system.get(reference, [])]
    if target is None:
        target = sum(ref) / len(ref) * (1 + target_rel) if ref else None
    rows = []
    for preset in dict.fromkeys(p for p, _ in clocks):
        ref_clock = clocks.get((preset, reference))
        ref_steps = [steps_to_target(c["val_curve"], target) for c in by_system.get(reference, [])] if target else []
        ref_mean = mean_se([s for s in ref_steps if s is not None])[0]
        for system, seeds in by_system.items():
            clock = clocks[(preset, system)]
            hits = [steps_to_target(c["val_curve"], target) for c in seeds] if target is not None else []
            reached = [h for h in hits if h is not None]
            row: Dict[str, Any] = {
                "preset": preset, "system": system, "seeds": [c["seed"] for c in seeds],
                "compressed_tiers": list(COMPRESSED_TIERS.get(system, ())) if system != DILOCO else ["dp (dense)"],
                "step_s": {b: clock[f"{b}_s"] for b in BOUNDS},
                "tokens_per_s": {b: clock["tokens_per_step"] / clock[f"{b}_s"] for b in BOUNDS},
                "bytes_per_step": clock["bytes_per_step"],
                "closed_form_bytes_per_step": clock.get("closed_form_bytes_per_step", {}),
                "final_val_loss": mean_se([c["final_val_loss"] for c in seeds]),
                "target_val_loss": target, "reached": f"{len(reached)}/{len(seeds)}",
                "steps_to_target": mean_se(reached),
                "time_to_target_s": {b: mean_se([h * clock[f"{b}_s"] for h in reached]) for b in BOUNDS},
                "curves": [c["val_curve"] for c in seeds],
            }
            if ref_clock is not None and ref_mean is not None:
                row["val_loss_at_reference_time"] = {
                    b: mean_se([loss_at_step(c["val_curve"], ref_mean * ref_clock[f"{b}_s"] / clock[f"{b}_s"])
                                for c in seeds]) for b in BOUNDS}
            rows.append(row)
    return rows


def _pm(pair: Sequence[Optional[float]], fmt: str = "{:.1f}") -> str:
    v, se = pair
    if v is None:
        return "not reached"
    return fmt.format(v) + (f" ± {fmt.format(se)}" if se is not None else "")


def _hours(pair: Sequence[Optional[float]]) -> str:
    v, se = pair
    return _pm((v / 3600 if v is not None else None, se / 3600 if se is not None else None), "{:.2f}")


def table(rows: Sequence[Mapping[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["preset", "budget", "system", "compressed tiers", "step s (full overlap | none)",
               "MiB/step tp | pp | dp",
               "closed form MiB/step tp | pp | dp", "final val loss", "steps to target", "reached",
               "time to target h (full overlap)", "time to target h (no overlap)", "val loss at dense 3D's time"]
    body = []
    for r in rows:
        cf = r["closed_form_bytes_per_step"]
        at = r.get("val_loss_at_reference_time", {}).get("lower")
        body.append([
            r["preset"], _budget(r), r["system"], ", ".join(r["compressed_tiers"]) or "none",
            f"{r['step_s']['lower']:.3f} | {r['step_s']['upper']:.3f}",
            " | ".join(fmt_bytes(r["bytes_per_step"].get(t), "MiB") for t in TIERS),
            " | ".join(fmt_bytes(cf.get(t), "MiB") for t in TIERS) if cf else "-",
            _pm(r["final_val_loss"], "{:.3f}"), _pm(r["steps_to_target"], "{:.0f}"), r["reached"],
            _hours(r["time_to_target_s"]["lower"]), _hours(r["time_to_target_s"]["upper"]),
            _pm(at, "{:.3f}") if at else "-",
        ])
    return headers, body


def _budget(r: Mapping[str, Any]) -> str:
    if r.get("budget") == "time":
        return f"equal time: {r['budget_steps']} steps ({r['budget_s'] / 3600:.2f} h)"
    return "equal tokens"


def _best(rows: Sequence[Mapping[str, Any]], names: Sequence[str], bound: str) -> Optional[Mapping[str, Any]]:
    """The row among `names` that reached the target in the most seeds, then soonest on `bound`."""
    cands = [r for r in rows if r["system"] in names and r["time_to_target_s"][bound][0] is not None]
    return min(cands, key=lambda r: (-int(r["reached"].split("/")[0]), r["time_to_target_s"][bound][0]),
               default=None)


def headline(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """Per preset, budget and bound: the best composed system (two or three tiers compressed) against dense 3D, the
    best single-tier system and dense DiLoCo, time to target on the clock, with the ratios against the goals. The
    equal-time line takes each system's equal-time row where it has one, else its equal-token row (more time can
    only help it: a lower bound on what that system gets)."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        tokens = {r["system"]: r for r in rows if r["preset"] == preset and r.get("budget", "tokens") == "tokens"}
        timed = {r["system"]: r for r in rows if r["preset"] == preset and r.get("budget") == "time"}
        budgets = [("equal tokens", tokens)] + ([("equal time", {**tokens, **timed})] if timed else [])
        for budget, mine in budgets:
            for bound in BOUNDS:
                lines.append(_headline_line(f"{preset}, {budget}", list(mine.values()), bound))
        lines.append(_looser_target(preset, list(tokens.values())))
    return [line for line in lines if line]


def _looser_target(preset: str, mine: Sequence[Mapping[str, Any]]) -> str:
    """Equal tokens at a looser target: the best composed system's own final loss (mean over seeds), every system's
    time to it (full overlap; each seed's first validation at or below it)."""
    composed = [r for r in mine if len(COMPRESSED_TIERS.get(r["system"], ())) >= 2 and r["final_val_loss"][0]]
    if not composed:
        return ""
    best = min(composed, key=lambda r: r["final_val_loss"][0])
    level = best["final_val_loss"][0]

    def hours(r: Mapping[str, Any]) -> Optional[float]:
        hits = [steps_to_target(c, level) for c in r["curves"]]
        reached = [h for h in hits if h is not None]
        return mean_se(reached)[0] * r["step_s"]["lower"] / 3600 if reached else None

    times = sorted(((hours(r), r["system"]) for r in mine), key=lambda t: (t[0] is None, t[0] or 0.0))
    listed = ", ".join(f"{s} {h:.2f} h" if h is not None else f"{s} not reached" for h, s in times)
    return (f"{preset}, equal tokens, looser target {level:.3f} (the best composed system's final loss, "
            f"{best['system']}), full overlap: {listed}")


def _headline_line(where: str, mine: Sequence[Mapping[str, Any]], bound: str) -> str:
    composed = [s for s, t in COMPRESSED_TIERS.items() if len(t) >= 2]
    single = [s for s, t in COMPRESSED_TIERS.items() if len(t) == 1]
    best = _best(mine, composed, bound)
    others = {"dense 3D": _best(mine, [DENSE], bound), "best single-tier": _best(mine, single, bound),
              "dense DiLoCo": _best(mine, [DILOCO], bound)}
    overlap = "full overlap" if bound == "lower" else "no overlap"
    if best is None:
        return f"{where} ({overlap}): no composed system reached the target"
    t = best["time_to_target_s"][bound][0]
    parts = [f"{where} ({overlap}): best composed {best['system']} {t / 3600:.2f} h ({best['reached']})"]
    for name, other in others.items():
        if other is None:
            parts.append(f"{name}: not reached")
            continue
        ratio = other["time_to_target_s"][bound][0] / t
        label = name if name != "best single-tier" else f"{name} ({other['system']})"
        parts.append(f"{label} {other['time_to_target_s'][bound][0] / 3600:.2f} h: {ratio:.2f}x "
                     f"(goal >= {GOALS[name]:g}x: {'met' if ratio >= GOALS[name] else 'NOT met'})")
    return "; ".join(parts)


def figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Left: validation loss against the clock's time (full-overlap bound, first preset, every seed); right: time
    to target per preset and system (bars: full overlap; the no-overlap bound as a tick)."""
    import matplotlib

    fig, (left, right) = new_figure(2, width=7.0)
    names = list(dict.fromkeys(r["system"] for r in rows))
    palette = matplotlib.colormaps["tab20"]
    colours = {s: palette(i % 20) for i, s in enumerate(names)}
    first = rows[0]["preset"] if rows else ""
    for r in (r for r in rows if r["preset"] == first):
        timed = r.get("budget") == "time"
        for i, curve in enumerate(r["curves"]):
            xs = [step * r["step_s"]["lower"] / 3600 for step, _ in curve]
            left.plot(xs, [loss for _, loss in curve], color=colours[r["system"]], lw=1.4 if i == 0 else 0.5,
                      ls="--" if timed else "-", label=r["system"] if i == 0 and not timed else None)
        if r["target_val_loss"] is not None:
            left.axhline(r["target_val_loss"], color="k", lw=0.6, ls="--")
    left.set_xscale("log")
    left.set(xlabel="modelled time (h, full-overlap bound, log)", ylabel="validation loss",
             title=f"{first}; black dashed: target; dashed: equal-time runs")
    left.legend(fontsize=5, ncol=2)
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    by = {(r["preset"], r["system"]): r for r in rows if r.get("budget", "tokens") == "tokens"}
    series = {s: [_h(by.get((p, s)), "lower") for p in presets] for s in names}
    errors = {s: [_h(by.get((p, s)), "lower", se=True) for p in presets] for s in names}
    grouped_bars(right, presets, series, errors, ylabel="time to target (h, full overlap; log)",
                 color=lambda s: colours[s])
    right.set_yscale("log")
    right.set_title("equal tokens; missing bar: target not reached")
    return fig


def _h(row: Optional[Mapping[str, Any]], bound: str, se: bool = False) -> Optional[float]:
    if row is None:
        return None
    v = row["time_to_target_s"][bound][1 if se else 0]
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v / 3600
