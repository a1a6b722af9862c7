"""The shared harness of this folder's table scripts: each row is M simulated SparseLoCo (or dense) replicas
in one process (nanotron_ext.sparseloco.simulate.run_simulated, equal to the distributed trainer bit for
bit), trained once per seed; a table is a dict of rows, reported as the mean and spread of the final
validation loss over seeds, with the paper's number beside ours.

CPU_SCALE is the scale every table here runs at unless the command line overrides it: tiny Llama
(d = 128, 4 layers, vocab 4096), the subspace codec after every layer but the last (a 4-stage pipeline on
one process), M = 4 replicas, sequence 64, micro-batch 4, 300 inner steps with H = 10 (30 outer syncs),
k = 32 of 4096, warm-up 30, cosine decay; about 45 s per run on one core.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple

from nanotron_ext.bench import presets
from nanotron_ext.bench import report as br
from nanotron_ext.bench.paper import PaperClaim, evaluate
from nanotron_ext.bench.report import help_with_defaults, new_figure, publish, read_saved, run_meta, save_figure
from nanotron_ext.config.loader import load_config
from nanotron_ext.sparseloco.simulate import run_simulated

CONFIG_FILE = "examples/config_tiny_het_sparseloco.yaml"
CPU_SCALE = ["tokens.train_steps=300", "sparseloco.inner_steps=10", "optimizer.warmup_steps=30",
             "tokens.sequence_length=64", "tokens.micro_batch_size=4", "tokens.batch_accumulation_per_replica=1",
             "tokens.val_steps=8", "model.codec.boundaries=every_layer"]
GPU_CONFIG = "reproduce/het_sparseloco/sparseloco_512m.yaml"
# the GPU preset simulates the M replicas in one process too (run_simulated): the 512M model of Table 1 at
# the paper's batch per replica, bf16, k = d / ratio on the compressed replicas, whose codec sits at the
# ends of the paper's 4 pipeline stages (12 layers: after layers 3, 6 and 9)
GPU_SCALE = ["model.codec.boundaries=[2, 5, 8]"]
Mode = Literal["sparseloco", "dense"]
Row = Tuple[Mode, List[str]]  # (outer loop, overrides on top of the table's base)


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options every table script takes (`name`: the default result runs/het_sparseloco/<name>)."""
    from nanotron_ext.cli_flags import CONFIG, Int, KeyValue, Parser, Text

    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", default=CONFIG_FILE, type=CONFIG,
                   help="CPU preset: the base config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="on top of CPU_SCALE (see reproduce/het_sparseloco/common.py)")
    p.add_argument("--replicas", type=Int(1), default=None,
                   help="M simulated replicas (default: 4; GPU preset: the paper's 8)")
    p.add_argument("--compressed", type=Int(0), default=None,
                   help="compressed replicas in the heterogeneous rows (default: half of --replicas)")
    p.add_argument("--ratio", type=Int(1), default=8, help="pipeline compression d/k of the compressed replicas")
    p.add_argument("--rows", nargs="+", type=Text(), help="a subset of the table's rows (default: all)")
    p.add_argument("--out", type=br.checked_out_path, default=Path(f"runs/het_sparseloco/{name}"),
                   help="writes <out>.json, <out>.md and <out>.png (default: %(default)s; a committed result under "
                        "reproduce/ is only extended or rewritten when --out names it)")
    p.add_argument("--from-json", metavar="JSON", type=br.SAVED_RESULT,
                   help="train nothing: re-render a result this script wrote to --out")
    p.add_argument("--fresh", action="store_true",
                   help="retrain every row and seed (by default a run stored here with the same overrides is reused: "
                        "after a code or data change, pass --fresh)")
    presets.add_preset_args(p, f"{GPU_CONFIG} (512M, the paper's batch per replica, bf16), M replicas simulated "
                               "in one process on one 80 GB GPU", seeds=(42, 43, 44))
    return p


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse; the GPU preset switches the base config and scale (CPU_SCALE is for the tiny model)."""
    args = help_with_defaults(p).parse_args(argv)
    args.replicas = args.replicas or (8 if args.preset == "gpu" else 4)
    args.compressed = args.compressed if args.compressed is not None else args.replicas // 2
    if args.preset == "gpu":
        args.config_file = GPU_CONFIG
        args.overrides = GPU_SCALE + presets.gpu_overrides(args) + args.overrides
    return args


def base_overrides(args: argparse.Namespace) -> List[str]:
    """CPU_SCALE (CPU preset) + the command line + M replicas (pp = 1: the pipeline is simulated by codec
    boundaries in one process) + k = d / ratio (names the key when d is not divisible)."""
    scale = CPU_SCALE if args.preset == "cpu" else ["parallelism.pp=1"]
    base = scale + args.overrides + [f"parallelism.dp={args.replicas}"]
    d = load_config(args.config_file, base).model.hidden_size
    if d % args.ratio:
        from nanotron_ext.cli_checks import ArgumentError  # (was exit code 1)

        raise ArgumentError(f"--ratio: model.hidden_size {d} is not divisible by {args.ratio}")
    return base + [f"model.subspace.k={d // args.ratio}"]


def replicas(n: int) -> str:
    """The override that compresses the first n replicas."""
    return f"sparseloco.compressed_replicas={list(range(n))}"


def run_row(config_file: str, overrides: Sequence[str], n_replicas: int,
            mode: Mode = "sparseloco") -> Dict[str, object]:
    """One training run: per-step mean train loss, final validation loss, bytes per replica per sync, wall time."""
    cfg = load_config(config_file, list(overrides))
    t0 = time.perf_counter()
    out = run_simulated(cfg, n_replicas, mode, config_file)
    return {"train_loss": out["train_loss"], "val_loss": out["val_loss"], "sync_bytes": out["sync_bytes"][:1],
            "wall_s": time.perf_counter() - t0, "overrides": list(overrides), "mode": mode}


def run_table(args: argparse.Namespace, rows: Mapping[str, Row], paper: Mapping[str, Optional[float]],
              title: str, extra_meta: Optional[Dict[str, object]] = None,
              plot: Optional[Callable[[Mapping[str, Dict[str, object]], Path],
                                      None]] = None) -> Dict[str, Dict[str, object]]:
    """Every row x seed (a row already in <out>.json with the same overrides and seed is kept, so a stopped
    sweep resumes); writes <out>.json after each run and <out>.png at the end (`plot(summary, png)`, default
    bars of ours beside the paper's); returns the summaries."""
    if args.from_json:
        data = read_saved(args.from_json)
        args.seeds = data["meta"]["seeds"]
        args.saved = data
        return data["summary"]
    names = args.rows or list(rows)
    unknown = sorted(set(names) - set(rows))
    if unknown:  # before any file is read or run trained (was exit code 1, after reading <out>.json)
        from nanotron_ext.cli_checks import refuse

        refuse(f"--rows {' '.join(unknown)}: not a row of this table; it has {', '.join(rows)}")
    base = base_overrides(args)
    if args.dry_run:
        presets.dry_run({f"{name} seed {seed}": (args.config_file, base + extra + [f"general.seed={seed}"])
                         for name, (mode, extra) in rows.items() if name in (args.rows or rows) for seed in args.seeds})
        raise SystemExit(0)
    path = args.out.with_suffix(".json")
    done = done_runs(path) if path.exists() and not args.fresh else {}
    # the same run in another row or table here is reused (Table 1's rows in Tables 2 and 4)
    known = {} if args.fresh else _runs_of_other_tables(path)
    known.update({(r["mode"], tuple(r["overrides"])): r for r in done.values()})
    for name in names:
        mode, extra = rows[name]
        for seed in args.seeds:
            key = f"{name} | seed {seed}"
            ovr = base + extra + [f"general.seed={seed}"]
            if key in done and done[key]["overrides"] == ovr and done[key]["mode"] == mode:
                continue
            if (mode, tuple(ovr)) in known:
                done[key] = known[(mode, tuple(ovr))]
                continue
            done[key] = known[(mode, tuple(ovr))] = run_row(args.config_file, ovr, args.replicas, mode)
            print(f"{name:<34} seed {seed}  val {done[key]['val_loss']:.4f}  ({done[key]['wall_s']:.0f} s)", flush=True)
            _write(path, args, base, done, rows, paper, title, extra_meta)
    summary = _write(path, args, base, done, rows, paper, title, extra_meta)
    args.saved = json.loads(path.read_text())
    return summary


def done_runs(path: Path) -> Dict[str, Dict[str, object]]:
    """The runs a stopped sweep left in <out>.json, read back to resume it: each with its mode, overrides and a
    finite validation loss, or the file is refused by name (an ArgumentError: one line, exit 2), never a traceback
    or a table of nan."""
    from nanotron_ext.cli_checks import JsonFile

    f = JsonFile(path, "--out", advice="move it away, or give --fresh to train every run again")
    runs = f.table(f.read_object(), "runs", dict)
    for key, run in runs.items():
        f.need(run, "mode", str, f"runs.{key}")
        f.need(run, "overrides", list, f"runs.{key}")
        f.number(run, "val_loss", f"runs.{key}")
    return runs


def _runs_of_other_tables(path: Path) -> Dict[Tuple[str, Tuple[str, ...]], Dict[str, object]]:
    """Runs already stored by the other tables of this folder, by (mode, overrides)."""
    found: Dict[Tuple[str, Tuple[str, ...]], Dict[str, object]] = {}
    for other in sorted(path.parent.glob("*.json")):
        if other == path:
            continue
        try:
            runs = json.loads(other.read_text()).get("runs", {})
        except (json.JSONDecodeError, AttributeError):
            continue
        for run in runs.values() if isinstance(runs, dict) else ():
            loss = run.get("val_loss") if isinstance(run, dict) else None
            if isinstance(run, dict) and "overrides" in run and "mode" in run and isinstance(loss, (int, float)) \
                    and math.isfinite(loss):  # a NaN another table holds is not reused here
                found[(run["mode"], tuple(run["overrides"]))] = run
    return found


def summarise(runs: Mapping[str, Dict[str, object]], rows: Mapping[str, Row],
              seeds: Sequence[int]) -> Dict[str, Dict[str, object]]:
    """Per row: validation losses per seed, their mean and sample standard deviation."""
    out: Dict[str, Dict[str, object]] = {}
    for name in rows:
        vals = [runs[f"{name} | seed {s}"]["val_loss"] for s in seeds if f"{name} | seed {s}" in runs]
        if vals:
            out[name] = {"val_loss": vals, "mean": statistics.fmean(vals),
                         "std": statistics.stdev(vals) if len(vals) > 1 else None, "seeds": len(vals)}
    return out


def paired_delta(runs: Mapping[str, Dict[str, object]], row: str, than: str,
                 seeds: Sequence[int]) -> Optional[Tuple[float, float]]:
    """Mean over seeds of val(row) - val(than), seed by seed (same data order and init), and its standard
    error; None unless both rows ran on at least two common seeds."""
    diffs = [runs[f"{row} | seed {s}"]["val_loss"] - runs[f"{than} | seed {s}"]["val_loss"] for s in seeds
             if f"{row} | seed {s}" in runs and f"{than} | seed {s}" in runs]
    if len(diffs) < 2:
        return None
    return statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5


def print_deltas(args: argparse.Namespace, pairs: Sequence[Tuple[str, str, str]],
                 paper: Mapping[str, Optional[float]],
                 plot: Optional[Callable[[Mapping[str, Dict[str, object]], Path],
                                         None]] = None) -> List[Dict[str, object]]:
    """For each (row, than, paper's ordering ">" / "<" / "="): our paired difference (mean over seeds +- s.e.),
    the paper's, and the verdict (bench.paper: ">" / "<" beyond 2 s.e., "=" within 2 s.e. of zero; one seed
    is undetermined). Prints header, rows and verdicts, writes <out>.json (+ "orderings", "paper") and
    <out>.md / <out>.png (`plot(summary, png)`, default bars of ours beside the paper's)."""
    data = args.saved
    meta = data["meta"]
    seeds = meta["seeds"]
    comps, claims = [], []
    for row, than, claim in pairs:
        d = paired_delta(data["runs"], row, than, seeds)
        p = None if paper.get(row) is None or paper.get(than) is None else round(paper[row] - paper[than], 4)
        key = f"{row} - {than}"
        comps.append({"key": key, "value": d and d[0], "err": d and d[1]})
        claims.append(PaperClaim(f"{row} minus {than}, val loss (paired over {len(seeds)} seeds)", "value", p,
                                 {">": ">", "<": "<", "=": "~"}[claim], 0.0, where={"key": key}, err_column="err",
                                 source=meta["title"].split(", ")[-1].split(" (")[0],
                                 setting="512M, DCLM, final train loss"))
    verdicts = evaluate(claims, comps)
    data["orderings"] = [{"row": row, "than": than, "paper_delta": c.paper, "claimed": claim, "ours_delta": v.measured,
                          "ours_se": v.err, "held": v.verdict, "verdict": v.status}
                         for (row, than, claim), c, v in zip(pairs, claims, verdicts)]
    summary = data["summary"]
    headers = ["row", "paper (final train loss)", "ours: val loss mean", "std", "per seed"]
    body = [[name, paper.get(name, "-") if paper.get(name) is not None else "-", f"{s['mean']:.4f}",
             "-" if s["std"] is None else f"{s['std']:.4f}", ", ".join(f"{v:.4f}" for v in s["val_loss"])]
            for name, s in summary.items()]
    rows = [{"row": name, **s, "paper": paper.get(name)} for name, s in summary.items()]
    notes = [f"M = {meta['replicas']} simulated replicas, {meta['compressed_in_het']} compressed in the heterogeneous "
             f"rows, d/k = {meta['ratio']}, seeds {seeds}; base overrides: `{' '.join(meta['base_overrides'])}`"]
    extra = {k: data[k] for k in ("summary", "runs", "orderings")}
    publish(args.out.with_suffix(".json"), rows, meta, meta["title"], headers, body, verdicts, notes=notes, extra=extra)
    png = args.out.with_suffix(".png")
    (plot or (lambda s, path: _bars(s, paper, path, meta["title"], meta)))(summary, png)
    return data["orderings"]


def _write(path: Path, args: argparse.Namespace, base: List[str], runs: Dict[str, Dict[str, object]],
           rows: Mapping[str, Row], paper: Mapping[str, Optional[float]], title: str,
           extra_meta: Optional[Dict[str, object]]) -> Dict[str, Dict[str, object]]:
    summary = summarise(runs, rows, args.seeds)
    meta = {"title": title, "config_file": args.config_file, "base_overrides": base, "replicas": args.replicas,
            "compressed_in_het": args.compressed, "ratio": args.ratio, "seeds": args.seeds, "preset": args.preset,
            **run_meta(),
            "rows": {n: {"mode": m, "overrides": o} for n, (m, o) in rows.items()}, "paper": dict(paper),
            **(extra_meta or {})}
    # marked as bench.report's: --out of a stopped sweep resumes from it (cli_checks.Writer)
    br.REPORT.write_json(path, {"meta": meta, "summary": summary, "runs": runs}, indent=1)
    return summary


def save_plot(fig: object, path: Path, title: str, meta: Mapping[str, object]) -> None:
    """The figure titled with what it shows, the device and date of the runs (bench.report.save_figure)."""
    save_figure(fig, path, title, meta)


def _bars(summary: Mapping[str, Dict[str, object]], paper: Mapping[str, Optional[float]], path: Path, title: str,
          meta: Mapping[str, object]) -> None:
    names = list(summary)
    fig, (ax, bx) = new_figure(2, width=5.5, height=0.45 * len(names) + 2)
    means = [summary[n]["mean"] for n in names]
    ax.barh(names, means, xerr=[summary[n]["std"] or 0 for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.plot(summary[n]["val_loss"], [i] * len(summary[n]["val_loss"]), "k.", ms=4)
    lo = min(min(summary[n]["val_loss"]) for n in names)
    ax.set_xlim(lo - 0.05, max(max(summary[n]["val_loss"]) for n in names) + 0.05)
    ax.invert_yaxis()
    ax.set_xlabel("ours: final validation loss (mean, std, seeds as dots)")
    known = [n for n in names if paper.get(n) is not None]
    bx.barh(known, [paper[n] for n in known], color="tab:gray")
    bx.set_xlim(min(paper[n] for n in known) - 0.1, max(paper[n] for n in known) + 0.1)
    bx.invert_yaxis()
    bx.set_xlabel("paper: final training loss")
    save_plot(fig, path, title, meta)
