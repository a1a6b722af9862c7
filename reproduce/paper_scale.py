"""The papers' throughput figures at paper scale, predicted: reproduce/results/PAPER_SCALE.{md,json,png}.

    .venv/bin/python reproduce/paper_scale.py [--from-json reproduce/results/PAPER_SCALE.json]

Each published throughput of the five papers (reproduce/paper_scale_rows.py) beside the model clock's prediction for
the same model, layout, batch and link: the config planned rank by rank (reproduce/paper_scale_plans.py: read from
reproduce/results/PLAN.json where plan_table.py plans it, else planned once and cached), priced on the paper's hardware
(nanotron_ext/bench/clock/hardware.py) and replayed (bench/clock/replay.py). The one fitted quantity is each hardware's
effective throughput, fitted on ONE named baseline row and held for every other row of its group; nothing else is
tuned. "Ours" is the full-overlap bound (a send does not stop its sender: NCCL's point-to-point on its own stream,
ProtocolNanoGPT's sender-stamped meter); the no-overlap bound is beside it. A row more than 25% off prints the clock's
breakdown (compute, bubble, and what each tier adds) and the reason (paper_scale_notes.py). Plans change only the
table's bytes and FLOPs: after reproduce/results/PLAN.json is regenerated, rerun this one command.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from reproduce.paper_scale_rows import MEASURED, NOT_PREDICTED, ROWS, UPDATE_TWINS, Row  # noqa: E402

OUT = REPO / "reproduce" / "results" / "PAPER_SCALE"
TOLERANCE = 0.25  # the goal: every predicted row within 25%
GEMM_GROUP = "boost"  # the rows whose prediction turns on GEMM shapes (--gemm-efficiency)


class Model:
    """Plans (read once) priced on presets: the numbers a row compares."""

    def __init__(self, gemm: Optional[Dict[str, Any]] = None) -> None:
        self.plans: Dict[str, Dict[str, Any]] = {}
        self.gemm = gemm  # bench/clock kernels.load_table's, or None: every FLOP at the fitted throughput
        self.mixes: Dict[str, float] = {}

    def scaled(self, run: str, group: str, tflops: float) -> float:
        """`tflops` for `run`: with a GEMM efficiency table, the BOOST group's runs at their decoder GEMMs' measured
        efficiency over that of the fit row's run (kernels.mix_efficiency): the fitted throughput stays the one
        fitted number, the table says only how each run's shapes fare against the fit's."""
        if self.gemm is None or group != GEMM_GROUP:
            return tflops
        return tflops * self.mix(run) / self.mix(next(r.runs[0] for r in ROWS if r.fit and r.group == group))

    def mix(self, run: str) -> float:
        from nanotron_ext.bench.clock import layer_gemms, mix_efficiency
        from nanotron_ext.config.loader import load_config
        from reproduce.paper_scale_plans import RUNS

        if run not in self.mixes:
            config, overrides = RUNS[run]
            self.mixes[run] = mix_efficiency(self.gemm, layer_gemms(load_config(REPO / config, list(overrides))))
        return self.mixes[run]

    def plan(self, name: str) -> Dict[str, Any]:
        """The run's plan; a Muon run's ranks carry their once-per-step update (its plan less its AdamW twin's)."""
        from nanotron_ext.bench.clock import with_update_flops
        from reproduce.paper_scale_plans import plan_of

        if name not in self.plans:
            plan = plan_of(name)
            if name in UPDATE_TWINS:
                plan = {**with_update_flops(plan, self.plan(UPDATE_TWINS[name])), "source": plan["source"]}
            self.plans[name] = plan
        return self.plans[name]

    def terms(self, run: str, row: Row, tflops: float) -> Dict[str, Any]:
        from nanotron_ext.bench.clock import HARDWARE
        from nanotron_ext.bench.step_time import clock_terms

        preset = HARDWARE[row.preset]
        if row.stage is not None:
            preset = dataclasses.replace(preset, stage=row.stage)
        return clock_terms(self.plan(run), preset, self.scaled(run, row.group, tflops), steady=row.steady)

    def value(self, row: Row, tflops: float) -> Tuple[float, float]:
        """The row's quantity at `tflops`: (full overlap, no overlap)."""
        if row.kind == "best_speedup":
            pairs = [self.value(dataclasses.replace(row, kind="speedup", runs=p), tflops) for p in row.pairs]
            return max(p[0] for p in pairs), max(p[1] for p in pairs)
        if row.kind == "block_us":
            us = sum(self.block_us(row, tflops, free_tp=False).values())
            return us, us
        tps = []
        for run in row.runs:
            t = self.terms(run, row, tflops)
            tokens = self.plan(run)["tokens_per_step"]
            tps.append((tokens / t["lower_s"], tokens / t["upper_s"]))
        if row.kind == "tokens_per_s":
            return tps[0]
        if row.kind == "step_s":
            tokens = self.plan(row.runs[0])["tokens_per_step"]
            return tokens / tps[0][0], tokens / tps[0][1]
        if row.kind == "speedup":
            return tps[0][0] / tps[1][0], tps[0][1] / tps[1][1]
        raise ValueError(f"unknown row kind {row.kind!r}")

    def block_us(self, row: Row, tflops: float, free_tp: bool) -> Dict[str, float]:
        """One block's forward (the two-layer run's less the one-layer run's), microseconds: {"compute_us",
        "tp_us"} (with `free_tp` the TP tier is free and "tp_us" is 0)."""
        from nanotron_ext.bench.clock import HARDWARE, links_of, replica_works
        from nanotron_ext.bench.step_time import FREE

        def forward(free: bool) -> float:
            tiers, stage = links_of(HARDWARE[row.preset], 1)
            if free:
                tiers = {"tp": FREE, "dp": FREE}
            fwd = [w.micro_batches * w.stages[0].fwd_s for run in row.runs
                   for w in replica_works(self.plan(run), tiers, stage, self.scaled(run, row.group, tflops) * 1e12)]
            return (fwd[0] - fwd[1]) * 1e6

        compute = forward(True)
        return {"compute_us": compute, "tp_us": 0.0 if free_tp else forward(False) - compute}

    def fit(self, row: Row) -> Optional[float]:
        """The effective TFLOP/s at which the row's full-overlap value equals the paper's (bisection in log
        TFLOP/s: every kind here moves monotonically with the throughput); None when no throughput reaches it."""
        faster = row.kind in ("tokens_per_s", "speedup")  # the value grows with the throughput
        lo, hi = math.log(1e-3), math.log(1e5)
        miss = lambda x: (self.value(row, math.exp(x))[0] - row.paper) * (1 if faster else -1)  # noqa: E731
        if miss(lo) > 0 or miss(hi) < 0:
            return None
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if miss(mid) > 0 else (mid, hi)
        return math.exp((lo + hi) / 2)


def compute(model: Model) -> Dict[str, Any]:
    """Fit each group, predict every row, collect the breakdowns of the rows that miss."""
    from nanotron_ext.bench.clock import HARDWARE

    fits: Dict[str, Dict[str, Any]] = {}
    for row in ROWS:
        if row.fit:
            tflops = model.fit(row)
            hw = HARDWARE[row.preset]
            # a row the links alone make slower than the paper's has no throughput to fit (its compute is a
            # rounding error of the step): the preset's stated throughput is used and the row is predicted too
            fits[row.group] = {"row": f"{row.source}: {row.label}", "fitted": tflops is not None,
                               "tflops": hw.tflops if tflops is None else tflops, "paper": row.paper,
                               "unit": row.unit, "preset": row.preset, "preset_tflops": hw.tflops,
                               "device": hw.device, "preset_source": hw.source}
    rows = [predict(model, row, fits) for row in ROWS]
    from reproduce.paper_scale_plans import RUNS, prune

    # every run is read once more (the curves read theirs already): what is left in the cache unread is orphaned
    gone = prune({model.plan(run)["source"] for run in RUNS})
    if gone:
        print(f"removed {len(gone)} cached plan(s) no run reads: {', '.join(gone)}", file=sys.stderr)
    gemm = {k: model.gemm[k] for k in ("device", "peak_tflops", "path")} if model.gemm else None
    return {"fits": fits, "rows": rows, **summary(rows), "cpu": summary([r for r in rows if not r["gpu_kernels"]]),
            "gemm_efficiency": gemm,
            "measured": [{"source": s, "measured": m, "why": y} for s, m, y in MEASURED],
            "not_predicted": [{"source": s, "what": w, "why": y} for s, w, y in NOT_PREDICTED],
            "curves": curves(model, fits), "date": datetime.date.today().isoformat()}


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Over the predicted rows among `rows`: how many, how many within 25%, the median |ours/paper - 1|."""
    predicted = [r for r in rows if r["predicted"]]
    return {"median_abs_error": statistics.median(r["error"] for r in predicted),
            "within_25": sum(r["error"] <= TOLERANCE for r in predicted), "predicted": len(predicted)}


def predict(model: Model, row: Row, fits: Dict[str, Any]) -> Dict[str, Any]:
    """One row's entry: ours (both bounds) against the paper's; a statement's parts each, its value the geometric
    mean of theirs (so its ratio is the geometric mean of theirs); a miss's breakdown."""
    tflops = fits[row.group]["tflops"]
    fitted = row.fit and fits[row.group]["fitted"]
    entry = {**{k: v for k, v in dataclasses.asdict(row).items() if k not in ("pairs", "parts")}, "tflops": tflops,
             "predicted": not fitted, "parts": []}
    subrows = list(row.parts) or [row]
    for part in subrows:
        low, high = model.value(part, tflops)
        entry["parts"].append({"label": part.label, "paper": part.paper, "stage": part.stage, "ours": low,
                               "ours_no_overlap": high, "ratio": low / part.paper,
                               "ratio_no_overlap": high / part.paper})
    geo = lambda key: math.exp(statistics.fmean(math.log(p[key]) for p in entry["parts"]))  # noqa: E731
    ratios = [p["ratio"] for p in entry["parts"]]
    # a statement's error is its parts' mean |ours/paper - 1|: misses in opposite directions do not cancel
    entry.update(paper=geo("paper"), ours=geo("ours"), ours_no_overlap=geo("ours_no_overlap"), ratio=geo("ratio"),
                 ratio_no_overlap=geo("ratio_no_overlap"), spread=[min(ratios), max(ratios)],
                 error=statistics.fmean(abs(r - 1) for r in ratios))
    if not row.parts:
        entry["parts"] = []
    runs = [r for part in subrows for r in ([x for pair in part.pairs for x in pair] if part.pairs else part.runs)]
    runs = list(dict.fromkeys(runs))
    if not fitted and entry["error"] > TOLERANCE:
        if row.kind == "block_us":
            entry["block"] = model.block_us(row, tflops, free_tp=False)
        else:
            entry["breakdown"] = {run: model.terms(run, next(p for p in subrows if run in p.runs or any(
                run in pair for pair in p.pairs)), tflops) for run in runs}
    entry["plans"] = {run: model.plan(run)["source"] for run in runs}
    return entry


def curves(model: Model, fits: Dict[str, Any]) -> Dict[str, Any]:
    """The figure's sweeps: ResBM Fig. A.2's gain over bandwidth at the fitted A10G; heterogeneous SparseLoCo
    Fig. 2's utilisation (step on free stage links / step on the link) of each replica kind at the assumed A100."""
    from nanotron_ext.bench.clock import HARDWARE, links_of, replica_works, step_bounds

    bws = [50 * 2 ** (i / 2) for i in range(17)]  # 50 Mbit/s .. 12.8 Gbit/s
    resbm: Dict[str, List[float]] = {}
    for opt in ("adamw", "muon"):
        row = Row("resbm", "", "", 1.0, "x", "speedup", (f"resbm_2b_128x_{opt}_pp8", "resbm_2b_baseline_pp8"),
                  "resbm-a10g-80m", steady=True)
        resbm[opt] = [model.value(dataclasses.replace(row, stage=(bw, 0.0)), fits["resbm"]["tflops"])[0] for bw in bws]
    het = HARDWARE["het-sparseloco-a100-1g"]
    plan = model.plan("sparseloco_512m_het_half")
    util: Dict[str, List[float]] = {"uncompressed": [], "compressed": []}
    for bw in bws:
        preset = dataclasses.replace(het, stage=(bw, 10.0), datacenter_replicas=())
        tiers, stage = links_of(preset, plan["layout"]["dp"])
        free = replica_works(plan, {"tp": tiers["tp"], "dp": tiers["dp"]}, [links_of(het, 8)[1][0]] * 8,
                             het.tflops * 1e12)
        slow = replica_works(plan, tiers, stage, het.tflops * 1e12)
        for kind, r in (("uncompressed", 0), ("compressed", 4)):
            base = step_bounds([free[r]], plan["outer_every"]).lower_s
            util[kind].append(base / step_bounds([slow[r]], plan["outer_every"]).lower_s)
    # what the outer step sends on the pipeline group beyond an inner one (the embedding fold): the clock prices
    # stage sends and the DP tier, not collectives on the pipeline group
    extra = max(sum(c["bytes"] for op, c in o["ledger"].get("pp", {}).items() if not op.startswith(("send", "recv")))
                - sum(c["bytes"] for op, c in i["ledger"].get("pp", {}).items() if not op.startswith(("send", "recv")))
                for oc, ic in zip(plan["outer"], plan["inner"]) for o, i in zip(oc, ic))
    return {"bandwidth_mbps": bws, "resbm_gain": resbm, "het_utilisation": util,
            "het_unpriced_pp_bytes_per_outer_step": extra}


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _breakdown(terms: Dict[str, Any]) -> str:
    """One line of the clock's terms (bench/step_time.clock_terms), seconds per step."""
    add = lambda k: f"{terms[k][0]:.3g} / {terms[k][1]:.3g}"  # noqa: E731
    update = f" (of which the once-per-step update {terms['update_s']:.3g})" if terms.get("update_s") else ""
    return (f"{'steady state: ' if terms.get('steady') else ''}compute {terms['compute_s']:.3g}{update}, bubble "
            f"{terms['bubble_s']:.3g}, + TP {add('tp_s')}, + stage links "
            f"{add('stage_link_s')} (busiest link carries data {terms['stage_wire_s']:.3g}), + DP {add('dp_s')} "
            f"-> {terms['lower_s']:.3g} / {terms['upper_s']:.3g} s")


def _headline(result: Dict[str, Any]) -> str:
    """The counts and medians: over every predicted row, and over those a CPU can decide (no GPU kernel timings)."""
    cpu = result["cpu"]
    return (f"**Every predicted row: {result['within_25']} of {result['predicted']} within 25%, median |ours/paper - "
            f"1| = {result['median_abs_error']:.3f}. Rows that need no GPU kernel timings: {cpu['within_25']} of "
            f"{cpu['predicted']} within 25%, median {cpu['median_abs_error']:.3f}.** "
            f"{len(result['not_predicted'])} published figures are not predicted (listed with the reason). GPU "
            + (f"kernel efficiency per GEMM shape: {g['path']} ({g['device']})." if (g := result.get("gemm_efficiency"))
               else "kernel efficiency per GEMM shape: not given (no GPU was lent to time it; every FLOP of a group at "
                    "its one fitted throughput)."))


def render(result: Dict[str, Any]) -> str:
    from reproduce.paper_scale_notes import MISSES

    rows, fits = result["rows"], result["fits"]
    lines = ["# The papers' throughput at paper scale, predicted by the model clock", "",
             f"{result['date']}; `.venv/bin/python reproduce/paper_scale.py` (JSON: "
             "`reproduce/results/PAPER_SCALE.json`, figure: `reproduce/results/PAPER_SCALE.png`). Each published "
             "throughput beside the model clock's prediction for the same model, layout, batch and link: the "
             "config planned rank by rank on the meta device (FLOPs, every message's bytes; "
             "`reproduce/paper_scale_plans.py`), priced on the paper's hardware "
             "(`nanotron_ext/bench/clock/hardware.py`: TP and DP tiers under NCCL's collective model, "
             "`nanotron_ext/parallel/link.py`) and replayed with its schedule, bubbles and links "
             "(`nanotron_ext/bench/clock/replay.py`), as a steady state or one flushed step as the paper measured "
             "(below); an optimiser's once-per-step work (Muon's Newton-Schulz) is priced once per step, at a stated "
             "rate. One number is fitted per hardware: its effective throughput, on the one row marked **fit**, then "
             "held for every other row of the group; no other constant is fitted. **Ours** is the full-overlap bound "
             "(a send does not stop its sender); the no-overlap bound is beside it. One config's "
             "step time on named hardware: `python -m nanotron_ext.bench.step_time --config-file X.yaml --preset "
             "NAME`.", "",
             _headline(result), "",
             "## Hardware (the one fitted number per group)", "",
             "| group | device | fitted on | paper | effective TFLOP/s | preset `--preset` |",
             "|---|---|---|---|---|---|"]
    for group, f in fits.items():
        how = f"{f['tflops']:.3g}" if f["fitted"] else f"{f['tflops']:.3g} (not fittable: see below)"
        lines.append(f"| {group} | {f['device']} | {f['row']} | {_num(f['paper'])} {f['unit']} | {how} | "
                     f"`{f['preset']}` |")
    lines += [f"\n{group}, not fitted: {f['preset_source']}" for group, f in fits.items() if not f["fitted"]]
    lines += ["", "## What each paper measured", "", "| source | priced as | why |", "|---|---|---|"]
    lines += [f"| {m['source']} | {m['measured']} | {m['why']} |" for m in result.get("measured", [])]
    lines += ["", "## Every row", "",
              "One row per published statement: a sentence covering several settings is one row, its parts listed "
              "below it, its ratio the geometric mean of theirs, the spread their least and greatest. *GPU kernels*: "
              "the prediction turns on GPU kernel efficiency per GEMM shape (no CPU can give it; `make gpu-check "
              "STAGES=gemm` measures it, `--gemm-efficiency` reads it).", "",
              "| source | row | paper | ours | ours, no overlap | ours / paper (spread) | within 25% | needs GPU "
              "kernels |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "**fit**" if not r["predicted"] else ("yes" if r["error"] <= TOLERANCE else "**no**")
        note = f" ({r['paper_note']})" if r["paper_note"] else ""
        spread = (f" ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}; error {r['error']:.3f})" if r["parts"] else "")
        shown = {k: " / ".join(_num(p[k]) for p in r["parts"]) if r["parts"] else _num(r[k])
                 for k in ("paper", "ours", "ours_no_overlap")}
        lines.append(f"| {r['source']} | {r['label']}{note} | {shown['paper']} {r['unit']} | {shown['ours']} | "
                     f"{shown['ours_no_overlap']} | {r['ratio']:.3f}{spread} | {ok} | "
                     f"{'yes' if r['gpu_kernels'] else ''} |")
        for p in r["parts"]:
            lines.append(f"| | - {p['label']} | {_num(p['paper'])} | {_num(p['ours'])} | {_num(p['ours_no_overlap'])}"
                         f" | {p['ratio']:.3f} | | |")
    lines += ["", "## Rows more than 25% off: the term that explains each, and whether the setting is stated", "",
              "Breakdowns: seconds per step of each run, full overlap / no overlap (`compute`: the slowest stage's "
              "forwards and backwards; `bubble`: the schedule's idle time on free links; then what each tier adds).",
              ""]
    for r in rows:
        if not r["predicted"] or r["error"] <= TOLERANCE:
            continue
        term, stated = MISSES.get((r["source"], r["label"]), ("(not yet explained)", "-"))
        kernels = " *Needs GPU kernel timings.*" if r["gpu_kernels"] else ""
        lines.append(f"- **{r['source']}, {r['label']}** ({r['ratio']:.2f}x): {term} *Stated well enough to "
                     f"model:* {stated}{kernels}")
        for run, terms in r.get("breakdown", {}).items():
            lines.append(f"  - `{run}`: {_breakdown(terms)}")
        if "block" in r:
            b = r["block"]
            lines.append(f"  - block forward: compute {b['compute_us']:.0f} us + TP {b['tp_us']:.0f} us")
    lines += ["", "## Not predicted", "", "| source | figure | why |", "|---|---|---|"]
    lines += [f"| {n['source']} | {n['what']} | {n['why']} |" for n in result["not_predicted"]]
    c = result["curves"]
    pick = lambda name, bw: c["het_utilisation"][name][min(range(len(c["bandwidth_mbps"])),  # noqa: E731
                                                            key=lambda i: abs(c["bandwidth_mbps"][i] - bw))]
    lines += ["", "Heterogeneous SparseLoCo Fig. 2 at an assumed A100 (100 TFLOP/s, `het-sparseloco-a100-1g`): "
              "utilisation = step over free stage links / step over the link, full overlap, outer sync included: "
              f"compressed (1/8) replicas {pick('compressed', 100):.3f} at 100 Mbit/s and "
              f"{pick('compressed', 1000):.3f}"
              f" at 1 Gbit/s (paper: > 0.97), uncompressed {pick('uncompressed', 100):.3f} / "
              f"{pick('uncompressed', 1000):.3f}. Not priced: collectives on the pipeline group, here the embedding "
              f"fold's {c.get('het_unpriced_pp_bytes_per_outer_step', 0) / 1e6:.1f} MB per outer step (at 1 Gbit/s "
              f"{c.get('het_unpriced_pp_bytes_per_outer_step', 0) * 8 / 1e9 * 1e3 / 50:.0f} ms per step amortised "
              "over H = 50).", "",
              "## Rerun", "",
              "`.venv/bin/python reproduce/paper_scale.py` (after `reproduce/results/PLAN.json` is regenerated too: "
              "the runs plan_table.py plans are read from it; the others are planned once and cached in "
              "`reproduce/results/plans/` by the hash of what changes a plan (nanotron_ext.plan.cache_key) and "
              "the planner's version; plans no run reads any more are removed). `--from-json "
              "reproduce/results/PAPER_SCALE.json` re-renders without the plans."]
    return "\n".join(lines) + "\n"


def plot(result: Dict[str, Any]) -> Any:
    """The figure: ours / paper per predicted row; ResBM Fig. A.2's gain and heterogeneous SparseLoCo Fig. 2's
    utilisation over the stage link's bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(20, 8), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    rows = [r for r in result["rows"] if r["predicted"]]
    y = list(range(len(rows)))[::-1]
    colours = {"resbm": "C0", "sm": "C1", "protocolnanogpt": "C2", "boost": "C3"}
    a.axvspan(0.75, 1.25, color="0.9")
    a.axvline(1.0, color="0.5", lw=0.8)
    a.scatter([r["ratio"] for r in rows], y, c=[colours[r["group"]] for r in rows], zorder=3)
    short = {"Protocol Models Table 1 (TPS)": "SM Table 1", "ProtocolNanoGPT records (Pluralis)": "ProtocolNanoGPT"}
    a.set_yticks(y, [f"{short.get(r['source'], r['source'])}: {r['label'][:60]}" for r in rows], fontsize=6)
    a.set_xscale("log")
    a.set_xlabel("ours / paper (full overlap); band: within 25%")
    a.set_title(f"median |ours/paper - 1| = {result['median_abs_error']:.3f} "
                f"(no GPU kernels: {result['cpu']['median_abs_error']:.3f})")
    cv = result["curves"]
    for opt, col in (("adamw", "C0"), ("muon", "C1")):
        b.plot(cv["bandwidth_mbps"], cv["resbm_gain"][opt], color=col, label=f"ours, ResBM {opt} 128x")
        pts = [p for r in result["rows"] if r["source"] == "ResBM Fig. A.2" for p in r["parts"]
               if opt in p["label"].lower()]
        b.scatter([p["stage"][0] for p in pts], [p["paper"] for p in pts], color=col, marker="x",
                  label=f"paper (1x: Table 3's own arithmetic), {opt}")
    b.set(xscale="log", yscale="log", xlabel="stage link, Mbit/s (half duplex)",
          ylabel="tokens/s over the uncompressed AdamW baseline", title="ResBM Fig. A.2 (8 x A10G, fitted)")
    b.legend(fontsize=7)
    for kind, col in (("compressed", "C2"), ("uncompressed", "C3")):
        c.plot(cv["bandwidth_mbps"], cv["het_utilisation"][kind], color=col, label=f"ours, {kind} replicas")
    c.axhline(0.97, color="0.4", ls="--", label="paper: > 97% (compressed, 100 Mbit/s - 1 Gbit/s)")
    c.axvspan(100, 1000, color="0.92")
    c.set(xscale="log", ylim=(0, 1.02), xlabel="stage link, Mbit/s (10 ms)", ylabel="utilisation",
          title="Heterogeneous SparseLoCo Fig. 2 (A100 assumed)")
    c.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.cli_checks import ArgumentError, JsonFile, Writer, output_files, refuse
    from nanotron_ext.cli_flags import InputFile, Parser
    from reproduce.paper_scale_saved import checked

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-json", default=None, type=InputFile(format="json"),
                        help="re-render a saved result, plan nothing (default: plan and predict)")
    parser.add_argument("--gemm-efficiency", default=None, type=InputFile(format="json"),
                        help="the per-GEMM-shape efficiency table `make gpu-check STAGES=gemm` wrote: BOOST's runs "
                             "priced at their shapes' measured efficiency relative to the fit row's")
    args = parser.parse_args(argv)
    writer = Writer("reproduce/paper_scale.py")
    try:  # replaced only when this script wrote them (cli_checks.Writer)
        output_files("output", OUT.with_suffix(".json"), writer, [OUT.with_suffix(".md"), OUT.with_suffix(".png")])
        if args.from_json:  # (garbage or another result was a traceback while rendering)
            saved = JsonFile(Path(args.from_json), "--from-json", advice="give the PAPER_SCALE.json this script wrote")
            result = checked(saved, saved.read_object())
    except ArgumentError as e:
        refuse(e)
    if not args.from_json:
        from nanotron_ext.bench.clock import load_table
        from nanotron_ext.errors import UserFacingError

        try:
            gemm = load_table(Path(args.gemm_efficiency)) if args.gemm_efficiency else None
            result = compute(Model(gemm))
        except UserFacingError as e:
            refuse(e)
        stale = [f"{f['preset']}: {f['preset_tflops']:g} vs fitted {f['tflops']:.3g}" for f in result["fits"].values()
                 if f["fitted"] and abs(f["preset_tflops"] / f["tflops"] - 1) > 0.01]
        if stale:
            print("note: nanotron_ext/bench/clock/hardware.py's throughputs differ from this fit by > 1%: "
                  + "; ".join(stale), file=sys.stderr)
    text = render(result)
    writer.write_json(OUT.with_suffix(".json"), result, indent=1)
    writer.write_markdown(OUT.with_suffix(".md"), text)
    writer.save_png(plot(result), OUT.with_suffix(".png"), dpi=110)
    print(text)
    print(f"wrote {OUT.with_suffix('.md')}, {OUT.with_suffix('.json')}, {OUT.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
