"""What the WAN meter (bench/wan/) makes of its runs: each run's loss-vs-wall-clock curve and time to target,
several saved results' runs merged (--merge), and the table and figure of the pooled rows."""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench.paper import PaperClaim, mean_se
from nanotron_ext.bench.report import fmt_bytes, grouped_bars, new_figure, read_saved
from nanotron_ext.bench.wan.presets import ANCHOR, TIERS
from nanotron_ext.bench.wan.systems import SYSTEMS
from nanotron_ext.cli_checks import ArgumentError


def run_curve(metrics: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Steady step time, and validation loss against cumulative step time, from a run's metrics.jsonl records."""
    times = [r["step_time_s"] for r in metrics if "step_time_s" in r]
    clock, val = 0.0, []
    for r in metrics:
        clock += r.get("step_time_s", 0.0)
        if "val_loss" in r:
            val.append([clock, r["val_loss"]])
    return {"steady_step_s": statistics.median(times[1:] or times), "val_vs_wall": val, "wall_s": clock}


def time_to_target(val_vs_wall: Sequence[Sequence[float]], target: float) -> Optional[float]:
    """Wall-clock (s) of the first validation at or below `target`; None when the run never reaches it."""
    return next((t for t, loss in val_vs_wall if loss <= target), None)


def loss_by(val_vs_wall: Sequence[Sequence[float]], wall_s: float) -> Optional[float]:
    """The validation loss a run had reached by wall-clock `wall_s`: its last validation at or before it."""
    seen = [loss for t, loss in val_vs_wall if t <= wall_s]
    return seen[-1] if seen else None


def _pm(v: Optional[float], se: Optional[float], fmt: str = "{:.2f}") -> str:
    if v is None:
        return "-"
    return fmt.format(v) + (f" ± {fmt.format(se)}" if se is not None else "")


def table(rows: Sequence[Mapping[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["preset", "system", "seeds", "steady step s", "x vs reference (step time)", "KiB/step tp | pp | dp",
               "closed form KiB/step tp | pp | dp",
               "waiting tp | pp | dp", "final val loss", "val loss at equal wall-clock", "target", "time to target s",
               "reached"]
    body = []
    for r in rows:
        w = r["link_wait_fraction"]
        body.append([
            r["preset"], r["system"], len(r["seeds"]), _pm(r["steady_step_s"], r["steady_step_s_se"], "{:.3f}"),
            _pm(r["step_time_ratio_vs_pipeline"], r["step_time_ratio_vs_pipeline_se"]),
            " | ".join(fmt_bytes(r["bytes_per_step"][t], "KiB") for t in TIERS),
            " | ".join(fmt_bytes(r["closed_form_bytes_per_step"].get(t), "KiB") for t in TIERS)
            if r.get("closed_form_bytes_per_step") else "-",
            " | ".join(f"{w.get(t, 0.0):.0%}" for t in TIERS) if w else "-",
            _pm(r["final_val_loss"], r["final_val_loss_se"], "{:.3f}"),
            _at_common_wall(r),
            "-" if r["target_val_loss"] is None else f"{r['target_val_loss']:.3f}",
            _pm(r["time_to_target_s"], r["time_to_target_s_se"], "{:.1f}") if r["time_to_target_s"] is not None
            else "not reached", r["reached"],
        ])
    return headers, body


COMPOSED, DENSE = "three_tiers", "dense_3d"
BASELINES = {"pipeline", "ddp", "megatron_tp", COMPOSED, DENSE}  # uncompressed layouts and the pair itself
GOALS = {DENSE: 3.0, "best single technique": 1.3}  # issue 30: three tiers this many times sooner


def headline(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """Per preset that has both: the three-tier job's wall-clock to target beside dense 3D's and the best single
    technique's (the one reaching the target in most seeds, then soonest), each mean ± s.e. (reached n/N), with
    the ratio of means against the goal. 'held' needs both intervals of 2 s.e. apart; a system that reached
    the target in no seed has no time."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        by = {r["system"]: r for r in rows if r["preset"] == preset}
        if COMPOSED not in by or DENSE not in by:
            continue
        singles = [r for s, r in by.items() if s not in BASELINES and r["time_to_target_s"] is not None]
        best = min(singles, key=lambda r: (-int(r["reached"].split("/")[0]), r["time_to_target_s"]), default=None)
        three = by[COMPOSED]
        parts = [f"{preset}: three tiers {_ttt(three)}"]
        for name, other in ((DENSE, by[DENSE]), ("best single technique", best)):
            if other is None:
                parts.append(f"{name}: none reached the target")
                continue
            label = name if name == DENSE else f"{name} ({other['system']})"
            parts.append(f"{label} {_ttt(other)}, {_sooner(three, other, GOALS[name])}")
        lines.append("; ".join(parts))
    for preset in dict.fromkeys(r["preset"] for r in rows):
        at = [r for r in rows if r["preset"] == preset and r.get("val_loss_at_common_wall") is not None]
        if at:
            order = sorted(at, key=lambda r: r["val_loss_at_common_wall"])
            lines.append(f"{preset}, at equal wall-clock ({at[0]['common_wall_s']:.0f} s of training, the shortest "
                         "run's): " + ", ".join(f"{r['system']} {r['val_loss_at_common_wall']:.3f}" for r in order))
    return lines


def _ttt(r: Mapping[str, Any]) -> str:
    t = r["time_to_target_s"]
    return f"{'not reached' if t is None else _pm(t, r['time_to_target_s_se'], '{:.1f}') + ' s'} ({r['reached']})"


def _sooner(three: Mapping[str, Any], other: Mapping[str, Any], goal: float) -> str:
    a, b = three["time_to_target_s"], other["time_to_target_s"]
    if a is None or b is None:
        return "no ratio"
    ratio = b / a
    se_a, se_b = three["time_to_target_s_se"] or 0.0, other["time_to_target_s_se"] or 0.0
    apart = abs(b - a) > 2 * (se_a + se_b)
    verdict = ("held" if ratio >= goal and apart else "not held" if ratio < goal and (apart or ratio < 1)
               else "undetermined")
    return f"three tiers {ratio:.2f}x sooner (goal >= {goal:g}x: {verdict})"


def _at_common_wall(r: Mapping[str, Any]) -> str:
    if r.get("val_loss_at_common_wall") is None:  # (results written before the column existed)
        return "-"
    loss = _pm(r["val_loss_at_common_wall"], r["val_loss_at_common_wall_se"], "{:.3f}")
    return f"{loss} at {r['common_wall_s']:.0f} s"


def figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Validation loss vs wall-clock (one line per system, first preset; thin lines: other seeds) and
    time-to-target bars per preset."""
    import matplotlib

    fig, (left, right) = new_figure(2, width=6.0)
    first = rows[0]["preset"] if rows else ""
    names = list(dict.fromkeys(r["system"] for r in rows))
    palette = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]  # tab10 repeats after 10 systems
    colours = {s: palette(i) for i, s in enumerate(names)}
    for r in (r for r in rows if r["preset"] == first):
        for i, curve in enumerate(r["curves"]):
            if curve:
                xs, ys = zip(*curve)
                left.plot(xs, ys, color=colours[r["system"]], lw=1.8 if i == 0 else 0.6, marker="o" if i == 0 else None,
                          ms=3, label=r["system"] if i == 0 else None)
        if r["target_val_loss"] is not None:
            left.axhline(r["target_val_loss"], color="k", lw=0.6, ls="--")
    left.set(xlabel="wall-clock (s, training steps only)", ylabel="validation loss", title=f"{first}; dashed: target")
    left.legend(fontsize=6, ncol=2 if len(names) > 8 else 1)
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    systems = list(colours)
    by = {(r["preset"], r["system"]): r for r in rows}
    series = {s: [by[(p, s)]["time_to_target_s"] if (p, s) in by else None for p in presets] for s in systems}
    errors = {s: [by[(p, s)]["time_to_target_s_se"] if (p, s) in by else None for p in presets] for s in systems}
    grouped_bars(right, presets, series, errors, ylabel="wall-clock to target validation loss (s)",
                 color=lambda s: colours[s])
    right.set_title("missing bar: target not reached (colours as on the left)")
    for i, preset in enumerate(presets):  # name the bars that are missing
        missed = [s for s in systems if (preset, s) in by and by[(preset, s)]["time_to_target_s"] is None]
        if missed:
            right.text(i, 0, "not reached:\n" + "\n".join(missed), ha="center", va="bottom", fontsize=6)
    return fig


def merged_runs(paths: Sequence[str]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The per-seed runs of several saved results and the first one's meta (with `merged_from`, and `batches`: each
    result's date, commit, load and --jobs, since step times depend on them); results that disagree on what pooling
    reads (the budget, the target's margin, a calibrated preset's links), or that hold no runs (written before runs
    were saved), are refused naming the file and the key, as are results of another shape or with a number that is
    not finite (args.check_saved_runs). The first result's reference sets the target (a later result may have timed
    its own systems to another one: pooling recomputes every target)."""
    from nanotron_ext.bench.wan.args import check_saved_runs

    runs: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {}
    seen: Dict[Tuple[str, str, int], str] = {}
    calibrated: Dict[str, Tuple[Any, str]] = {}
    for path in paths:
        saved = read_saved(path, "--merge")
        if not saved.get("runs"):
            raise ArgumentError(f"--merge {path}: it holds no per-seed runs (a result written before the meter saved "
                                "them); measure it again")
        check_saved_runs("--merge", path, saved)
        for key in ("steps", "target_rel"):
            if meta and saved["meta"].get(key) != meta.get(key):
                raise ArgumentError(f"--merge {path}: {key} {saved['meta'].get(key)!r} differs from {paths[0]}'s "
                                    f"{meta.get(key)!r}; pooled runs must share it")
        links = saved["meta"].get("anchor_calibration", {}).get("links_mbps_ms", {})
        for preset, tiers in links.items():  # a calibrated preset's runs pool only over the same scaled links
            if calibrated.setdefault(preset, (tiers, path))[0] != tiers:
                raise ArgumentError(f"--merge {path}: its calibrated links of {preset} {tiers} differ from "
                                    f"{calibrated[preset][1]}'s {calibrated[preset][0]} (measure with "
                                    f"--calibration-from {calibrated[preset][1]})")
        meta = meta or {**saved["meta"], "merged_from": list(paths), "batches": []}
        meta["batches"].append({"from": path, "systems": sorted({r["system"] for r in saved["runs"]}),
                                **{k: saved["meta"].get(k) for k in ("date", "commit", "loadavg_1m", "jobs")}})
        for run in saved["runs"]:
            key = (run["preset"], run["system"], run["seed"])
            if key in seen:
                raise ArgumentError(f"--merge {path}: {key[1]} seed {key[2]} on {key[0]} is also in {seen[key]}")
            seen[key] = path
            runs.append(run)
    if not any(r["system"] == meta.get("reference") for r in runs):
        raise ArgumentError(f"--merge: no result holds runs of {paths[0]}'s reference {meta.get('reference')}, whose "
                            "final validation loss sets the target")
    return runs, meta


CLAIMS = [
    PaperClaim("step time uncompressed / subspace-compressed pipeline", "step_time_ratio_vs_pipeline", 5.05,
               ">", 1.0, where={"system": "subspace_pipeline", "preset": ANCHOR},
               err_column="step_time_ratio_vs_pipeline_se", source="ProtocolNanoGPT",
               setting="200 Mbit/s + 50 ms per stage, 100.5 vs 19.9 s/step; ours: its compute:comm ratio scaled"),
    PaperClaim("step time uncompressed / subspace pipeline, unscaled link (CPU compute-bound: value only)",
               "step_time_ratio_vs_pipeline", 5.05, None, where={"system": "subspace_pipeline",
                                                                 "preset": "internet-200m-50ms"},
               err_column="step_time_ratio_vs_pipeline_se", source="ProtocolNanoGPT",
               setting="200 Mbit/s + 50 ms per stage, 100.5 vs 19.9 s/step; ours: the same link, our compute"),
    PaperClaim("step time uncompressed / ResBM 128x pipeline (throughput gain)", "step_time_ratio_vs_pipeline",
               7837 / 609, ">", 1.0, where={"system": "resbm_pipeline", "preset": "resbm-80m-cpu"},
               err_column="step_time_ratio_vs_pipeline_se", source="ResBM Table 3",
               setting="80 Mbit/s half duplex, 609 vs 7837 tok/s (AdamW 128x); ours: its compute:comm ratio scaled"),
]


def pooled_rows(runs: Sequence[Mapping[str, Any]], reference: str, target_rel: float) -> List[Dict[str, Any]]:
    """One row per (preset, system): means and standard errors over seeds, time to the preset's target."""
    rows: List[Dict[str, Any]] = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        mine = [r for r in runs if r["preset"] == preset]
        ref = [r["final_val_loss"] for r in mine if r["system"] == reference and r["final_val_loss"] is not None]
        target = statistics.fmean(ref) * (1 + target_rel) if ref else None
        ref_step = statistics.fmean([r["steady_step_s"] for r in mine if r["system"] == reference] or [math.nan])
        # equal wall-clock: the shortest run's training time, where every run still has a measured loss
        common = min((r["val_vs_wall"][-1][0] for r in mine if r["val_vs_wall"]), default=None)
        for system in dict.fromkeys(r["system"] for r in mine):
            seeds = [r for r in mine if r["system"] == system]
            step, step_se = mean_se([r["steady_step_s"] for r in seeds])
            loss, loss_se = mean_se([r["final_val_loss"] for r in seeds])
            hits = [time_to_target(r["val_vs_wall"], target) for r in seeds] if target is not None else []
            reached = [h for h in hits if h is not None]
            ttt, ttt_se = mean_se(reached)
            ratios = [ref_step / r["steady_step_s"] for r in seeds]
            ratio, ratio_se = mean_se(ratios)
            waits = [r["link_wait_fraction"] for r in seeds if r["link_wait_fraction"]]
            at_common, at_common_se = mean_se([loss_by(r["val_vs_wall"], common) for r in seeds]
                                              if common is not None else [])
            rows.append({
                "preset": preset, "system": system, "label": SYSTEMS[system].label if system in SYSTEMS else system,
                "seeds": [r["seed"] for r in seeds], "steady_step_s": step, "steady_step_s_se": step_se,
                "step_time_ratio_vs_pipeline": ratio if math.isfinite(ratio) else None,
                "step_time_ratio_vs_pipeline_se": ratio_se,
                "bytes_per_step": {t: statistics.fmean(r["bytes_per_step"][t] for r in seeds) for t in TIERS},
                "closed_form_bytes_per_step": seeds[0].get("closed_form_bytes_per_step", {}),
                "link_wait_fraction": {t: statistics.fmean(w.get(t, 0.0) for w in waits)
                                       for t in TIERS} if waits else {},
                "final_val_loss": loss, "final_val_loss_se": loss_se, "target_val_loss": target,
                "common_wall_s": common, "val_loss_at_common_wall": at_common,
                "val_loss_at_common_wall_se": at_common_se,
                "time_to_target_s": ttt, "time_to_target_s_se": ttt_se, "reached": f"{len(reached)}/{len(seeds)}",
                "curves": [r["val_vs_wall"] for r in seeds],
            })
    return rows
