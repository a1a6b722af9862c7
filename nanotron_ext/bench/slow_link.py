"""The slow-link throughput benchmark every boundary codec shares (ResBM Table 3 / fig. A.2 style).

The same model is trained at PP >= 2 over emulated pipeline links (parallelism.link) for every codec
setting x bandwidth x duplex given, through the real trainer (torchrun -m nanotron_ext.train), and
for each run the script reports:

- tokens/s: tokens per step / the median step time of the trainer's metrics.jsonl, first step excluded
  (the trainer's mean, summary.json, is kept beside it as tokens_per_s_mean);
- data bytes per optimiser step per boundary per direction, from the ledger ("pp:send:fwd/bwd"), and a
  codec's once-per-step shared-parameter exchange on the same links ("pp:send:codec_grads:fwd/bwd", MAPL);
- the link-bound tokens/s those bytes allow (data + exchange): tokens_per_step / link seconds per step, where
  a step needs max(fwd, bwd) * 8 / bandwidth seconds on a full-duplex link and (fwd + bwd) * 8 / bandwidth
  on a half-duplex one (one budget for both directions);
- the training loss reached within a fixed wall-clock budget (cumulative step time, metrics.jsonl).

    python -m nanotron_ext.bench.slow_link --config reproduce/resbm/cpu_base.yaml \
        --setting "uncompressed:model.codec.kind=identity" \
        --setting "resbm_128x:model.codec.kind=resbm,model.codec.resbm.h=2" \
        --bandwidth 1.6 --bandwidth 200 --duplex half --pp 2 --steps 6 --budget-s 20 \
        --out runs/slow_link/result.json --png runs/slow_link/throughput.png

A bandwidth of 0 means an unlimited link. Extra `--set key=value` overrides go to every run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import yaml

from nanotron_ext.bench.report import REPORT, run_meta, write_rows
from nanotron_ext.cli_flags import one_line_refusals

REPO = Path(__file__).resolve().parents[2]


def parse_setting(text: str) -> Tuple[str, List[str]]:
    """'name:key=value,key=value' -> (name, ['key=value', ...])."""
    from nanotron_ext.cli_flags import FlagValueError, Text

    name, _, rest = Text()(text).partition(":")
    if not name or (rest and "=" not in rest):
        raise FlagValueError(f"{text!r}: expected NAME:key=value[,key=value...]")
    return name, [kv for kv in rest.split(",") if kv]


def link_bound_tokens_per_s(tokens_per_step: float, fwd_bytes: float, bwd_bytes: float, mbps: float,
                            duplex: str) -> Optional[float]:
    """Tokens/s the link alone allows, from one boundary's bytes per step (None for an unlimited link)."""
    if mbps <= 0:
        return None
    bits = (fwd_bytes + bwd_bytes if duplex == "half" else max(fwd_bytes, bwd_bytes)) * 8
    return tokens_per_step * mbps * 1e6 / bits if bits else None


def loss_within(metrics: Sequence[dict], budget_s: float) -> Optional[float]:
    """Training loss of the last step finished within `budget_s` of summed step time."""
    elapsed, loss = 0.0, None
    for rec in metrics:
        if "step_time_s" not in rec:
            continue
        elapsed += rec["step_time_s"]
        if elapsed > budget_s:
            break
        loss = rec["loss"]
    return loss


def median_tokens_per_s(metrics: Sequence[dict], tokens_per_step: int) -> float:
    """tokens_per_step / median step time, first step excluded: robust to a CPU shared with other jobs
    (the trainer's summary holds the mean, kept beside it)."""
    times = [r["step_time_s"] for r in metrics if "step_time_s" in r]
    median = statistics.median(times[1:] or times)
    return tokens_per_step / median


def run_one(args: argparse.Namespace, name: str, overrides: List[str], mbps: float, duplex: str,
            shaped: bool = False) -> dict:
    """One trainer run; `shaped`: over a real tc-tbf link between two network namespaces
    (scripts/netns_pipeline.sh, root, PP=2, each direction shaped on its own = full duplex) instead of
    the emulator."""
    run = f"{name}_{mbps:g}mbps_{'shaped' if shaped else duplex}".replace(".", "p")
    out_dir = Path(args.output_dir)
    emulate = mbps > 0 and not shaped
    sets = [f"parallelism.pp={args.pp}", "parallelism.dp=1", "parallelism.tp=1", "model.codec.boundaries=stages",
            f"parallelism.link.enabled={'true' if emulate else 'false'}", f"parallelism.link.bandwidth_mbps={mbps}",
            f"parallelism.link.duplex={duplex}", f"general.run={run}", f"general.output_dir={out_dir}",
            f"tokens.train_steps={args.steps}", "tokens.val_check_interval=0", "tokens.val_steps=1",
            f"checkpoints.dir={out_dir / 'checkpoints' / run}", "checkpoints.resume=overwrite",
            "logging.progress_bar=false", *args.set, *overrides]
    train = ["-m", "nanotron_ext.train", "--config-file", args.config]
    if shaped:
        if args.pp != 2 or duplex != "full":
            raise ValueError("a shaped link joins two ranks and shapes each direction separately: --pp 2, full duplex")
        cmd = ["bash", "scripts/netns_pipeline.sh", "--rate", f"{mbps * 1000:g}kbit", "--", sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.pp}", *train]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    shutil.rmtree(REPO / out_dir / run, ignore_errors=True)  # a repeated point must not read stale metrics
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    run_dir = REPO / out_dir / run
    summary_file = run_dir / "summary.json"
    finished = summary_file.exists() and json.loads(summary_file.read_text()).get("steps") == args.steps
    if proc.returncode != 0 and not finished:
        raise RuntimeError(f"run {run} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:  # trained and wrote its summary, then failed on the way out: keep the row, say so
        print(f"warning: run {run} finished all {args.steps} steps but exited with {proc.returncode}: "
              f"{(proc.stderr.strip().splitlines() or ['?'])[0][:200]}", file=sys.stderr)
    summary = json.loads(summary_file.read_text())
    summary["exit_status"] = proc.returncode
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = _resolved(run_dir)
    tokens_per_step = cfg["tokens"]["micro_batch_size"] * cfg["tokens"]["sequence_length"] * \
        cfg["tokens"]["batch_accumulation_per_replica"]
    boundaries = args.pp - 1
    comm = summary["comm_bytes_per_step"]
    fwd, bwd = comm.get("pp:send:fwd", 0) / boundaries, comm.get("pp:send:bwd", 0) / boundaries
    sync_fwd = comm.get("pp:send:codec_grads:fwd", 0) / boundaries
    sync_bwd = comm.get("pp:send:codec_grads:bwd", 0) / boundaries
    return {
        "setting": name, "overrides": overrides, "bandwidth_mbps": mbps, "duplex": duplex, "run": run,
        "link": "shaped (netns + tc tbf)" if shaped else ("emulated" if emulate else "unlimited"),
        "tokens_per_s": median_tokens_per_s(metrics, tokens_per_step), "tokens_per_s_mean": summary["tokens_per_s"],
        "tokens_per_step": tokens_per_step,
        "bytes_per_step_per_boundary": {"fwd": fwd, "bwd": bwd, "codec_sync_fwd": sync_fwd, "codec_sync_bwd": sync_bwd},
        "link_bound_tokens_per_s": link_bound_tokens_per_s(tokens_per_step, fwd + sync_fwd, bwd + sync_bwd, mbps,
                                                           duplex),
        "loss_within_budget": loss_within(metrics, args.budget_s), "budget_s": args.budget_s,
        "final_train_loss": summary["final_train_loss"], "steps": summary["steps"], "wall_s": time.time() - t0,
        "exit_status": summary["exit_status"],
        # a run that trained but exited non-zero keeps what it printed last, so the cause can be traced
        **({"exit_stderr_tail": proc.stderr[-2000:]} if proc.returncode != 0 else {}),
    }


def _resolved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def format_rows(rows: Sequence[dict]) -> str:
    head = f"{'setting':<16} {'Mbit/s':>8} {'duplex':>6} {'tokens/s':>9} {'link-bound':>11} {'fwd B/step':>11} " \
           f"{'bwd B/step':>11} {'sync B/step':>11} {'loss@budget':>11}"
    lines = [head]
    for r in rows:
        lb = r["link_bound_tokens_per_s"]
        loss = r["loss_within_budget"]
        b = r["bytes_per_step_per_boundary"]
        sync = b.get("codec_sync_fwd", 0) + b.get("codec_sync_bwd", 0)
        lines.append(f"{r['setting']:<16} {r['bandwidth_mbps']:>8g} {r['duplex']:>6} {r['tokens_per_s']:>9.0f} "
                     f"{(f'{lb:.0f}' if lb else 'inf'):>11} {b['fwd']:>11.0f} {b['bwd']:>11.0f} {sync:>11.0f} "
                     f"{(f'{loss:.3f}' if loss else '-'):>11}")
    return "\n".join(lines)


def figure(rows: Sequence[dict]) -> Any:
    """tokens/s against link bandwidth, one line per (setting, duplex)."""
    from nanotron_ext.bench.report import new_figure  # matplotlib only when plotting (seconds to import)

    fig, ax = new_figure(1, width=6.4, height=4.2)
    for (setting, duplex) in sorted({(r["setting"], r["duplex"]) for r in rows}):
        pts = sorted((r["bandwidth_mbps"], r["tokens_per_s"]) for r in rows
                     if r["setting"] == setting and r["duplex"] == duplex and r["bandwidth_mbps"] > 0)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{setting} ({duplex} duplex)")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    REPORT.save_png(fig, path, dpi=110)
    plt.close(fig)


def table(rows: Sequence[dict]) -> Tuple[List[str], List[List[Any]]]:
    """(headers, body) of the benchmark's rows for bench.report."""
    headers = ["setting", "Mbit/s", "duplex", "tokens/s", "link-bound tokens/s", "fwd B/step",
               "bwd B/step", "loss@budget"]
    body = [[r["setting"], f"{r['bandwidth_mbps']:g}", r["duplex"], f"{r['tokens_per_s']:.0f}",
             f"{r['link_bound_tokens_per_s']:.0f}" if r["link_bound_tokens_per_s"] else "inf",
             f"{r['bytes_per_step_per_boundary']['fwd']:,.0f}", f"{r['bytes_per_step_per_boundary']['bwd']:,.0f}",
             f"{r['loss_within_budget']:.3f}" if r["loss_within_budget"] else "-"] for r in rows]
    return headers, body


def build_parser() -> argparse.ArgumentParser:
    from nanotron_ext.cli_flags import Float, InputFile, Int, KeyValue, OutputFile, OutputFolder, Parser, Text

    # every path the benchmark writes is checked when parsed, before any run (the rule of cli_checks.Writer)
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=InputFile(format="yaml"))
    ap.add_argument("--setting", action="append", type=parse_setting, required=True, help="NAME:key=value,...")
    ap.add_argument("--bandwidth", action="append", type=Float(0.0), required=True, help="Mbit/s (0 = unlimited)")
    ap.add_argument("--duplex", action="append", choices=["full", "half"], default=None)
    ap.add_argument("--pp", type=Int(1), default=2)
    ap.add_argument("--shaped", action="store_true", help="also run every point over a real shaped link (root)")
    ap.add_argument("--steps", type=Int(1), default=6)
    ap.add_argument("--budget-s", type=Float(0.0, low_open=True), default=30.0,
                    help="wall-clock budget for the loss column")
    ap.add_argument("--set", action="append", default=[], type=KeyValue(), help="key=value for every run")
    ap.add_argument("--output-dir", default="runs/slow_link", type=OutputFolder(), help="where the runs' folders go")
    ap.add_argument("--out", type=OutputFile(REPORT, as_path=True), default=None,
                    help="the rows as JSON (or CSV for a .csv name)")
    ap.add_argument("--png", type=OutputFile(REPORT, as_path=True), default=None, help="the throughput figure")
    ap.add_argument("--title", type=Text(), default=None)
    return ap


def run_grid(args: argparse.Namespace,
             grid: Optional[Sequence[Tuple[str, List[str], float, str]]] = None) -> List[dict]:
    """Every (setting, bandwidth, duplex) of the arguments, or the explicit `grid` of such tuples."""
    if grid is None:
        grid = [(n, o, bw, dx) for n, o in args.setting for bw in args.bandwidth for dx in (args.duplex or ["half"])]
    rows = []
    for name, overrides, bw, dx in grid:
        for shaped in ([False, True] if getattr(args, "shaped", False) and bw > 0 else [False]):
            rows.append(run_one(args, name, overrides, bw, dx, shaped=shaped))
            print(format_rows(rows[-1:]).splitlines()[1] + f"  ({rows[-1]['link']})", flush=True)
    return rows


def device_title(what: str) -> str:
    """`what` - the machine and backend this runs on (bench.report), today's date."""
    from nanotron_ext.bench.report import default_backend, machine_label

    return f"{what} - {machine_label()}, {default_backend()}, {datetime.date.today().isoformat()}"


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    args = build_parser().parse_args(argv)
    from nanotron_ext.config.loader import load_config

    for _, overrides in args.setting:  # each setting's config before the first run (a ConfigError: one line)
        load_config(args.config, [*args.set, *overrides])
    rows = run_grid(args)
    print(format_rows(rows))
    if args.out:
        write_rows(args.out, rows, run_meta())
    if args.png:
        plot(rows, args.png, args.title or device_title("throughput vs bandwidth"))
    return rows


if __name__ == "__main__":
    main()
