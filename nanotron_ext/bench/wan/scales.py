"""Loss runs at more than one model size (issue 51 item 3): how the per-token penalty of each system against dense
3D (steps to dense's target) moves with the model's size.

    python -m nanotron_ext.bench.wan.scales train --size d256 --systems dense_3d --budget 150 --seeds 1
    python -m nanotron_ext.bench.wan.scales report --out reproduce/wan/results/loss_scales.json

A size is a base YAML (SIZES): d128 is the meter's own reproduce/wan/cpu_base.yaml, so its runs are the meter's
(`--clock model` with the same steps finds them in the same cache); a larger size is the model keys its YAML changes,
set on every system's run (the 3D systems start from examples/config_three_tiers.yaml, whose model is cpu_base's).
The protocol (PROTOCOL): dense 3D trains REFERENCE_STEPS and sets the target (its final validation loss, mean over
seeds, x 1.02: the meter's rule); a system trains REFERENCE_STEPS too, or LONG_STEPS (its own cosine over them) where
it does not reach the target at REFERENCE_STEPS; its steps to target come from the shortest budget at which every
seed trained reached it (else the longest trained). LONG_STEPS x tokens per step stays within one pass over the
corpus: no run repeats data. `report` reads only the cache (`--runs`), so it regenerates without training.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from nanotron_ext.bench.wan.losses import LossRun, loss_runs, train_all
from nanotron_ext.bench.wan.model_results import steps_to_target
from nanotron_ext.bench.wan.systems import BASE, REPO, SYSTEMS

SIZES = {"d128": BASE, "d256": "reproduce/wan/cpu_base_d256.yaml"}
REFERENCE, TARGET_REL = "dense_3d", 0.02
REFERENCE_STEPS, LONG_STEPS, VAL_EVERY, INNER_STEPS = 150, 450, 10, 10  # what 2 shared cores allowed (README)
BUDGETS = (REFERENCE_STEPS, LONG_STEPS)
SEEDS = (1, 2, 3)
# the systems the regime map needs (dense, both dense outer loops, the composition) and the single techniques that
# may be the best one at d = 128 (the report names it)
STUDY = ("dense_3d", "3d_diloco", "3d_diloco_nesterov", "three_tiers", "3d_int4", "3d_btp", "3d_mapl", "3d_sm",
         "3d_sparseloco")
SINGLE = ("3d_int4", "3d_btp", "3d_mapl", "3d_sm", "3d_resbm", "3d_sparseloco")
RUNS = "runs/wan_scales"


def _flat(section: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in section.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def size_overrides(size: str) -> List[str]:
    """The model keys the size's YAML sets differently from cpu_base.yaml's (none for d128), as overrides."""
    from nanotron_ext.config.loader import config_to_dict, load_config

    base = _flat(config_to_dict(load_config(REPO / BASE, []))["model"], "model.")
    mine = _flat(config_to_dict(load_config(REPO / SIZES[size], []))["model"], "model.")
    return [f"{k}={_value(v)}" for k, v in mine.items() if base.get(k) != v]


def size_args(size: str, steps: int) -> argparse.Namespace:
    """The meter's arguments for one size and budget (what loss_runs reads)."""
    return argparse.Namespace(config=SIZES[size], steps=steps, val_every=VAL_EVERY, inner_steps=INNER_STEPS,
                              set=size_overrides(size), tp_preset="nvlink")


def planned(size: str, systems: Sequence[str], budget: int, seeds: Sequence[int]) -> List[LossRun]:
    return loss_runs(list(systems), list(seeds), size_args(size, budget))


def _cached(folder: Path, run: LossRun) -> Optional[Dict[str, Any]]:
    """A finished curve of `run`, checked as losses.py reads it (a damaged one is said in one line, not read)."""
    from nanotron_ext.bench.wan.losses import finished

    return finished(folder, run.key(), run.seed)


def model_size(size: str) -> Dict[str, int]:
    """hidden size, non-embedding parameters (the whole model less the untied embedding and head) and tokens per
    step of the size's base YAML."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.models.param_count import count_params

    cfg = load_config(REPO / SIZES[size], [])
    m, t = cfg.model, cfg.tokens
    tables = (1 if m.tie_embeddings else 2) * m.vocab_size * m.hidden_size
    return {"hidden_size": m.hidden_size, "non_embedding_params": count_params(cfg) - tables,
            "tokens_per_step": cfg.parallelism.dp * t.micro_batch_size * t.batch_accumulation_per_replica
            * t.sequence_length}


def corpus_tokens(size: str) -> Optional[int]:
    """Training tokens of the prepared data the size's runs read (its manifest), None when not prepared."""
    from nanotron_ext.config.loader import load_config

    manifest = REPO / load_config(REPO / SIZES[size], []).data.prepared_dir / "manifest.json"
    try:
        return int(json.loads(manifest.read_text())["splits"]["train"]["tokens"])
    except (OSError, ValueError, KeyError):
        return None


def size_result(size: str, folder: Path) -> Optional[Dict[str, Any]]:
    """One size's entry of the JSON from the cached runs (None: no reference run cached)."""
    ref_runs = [(s, _cached(folder, r)) for s, r in zip(SEEDS, planned(size, [REFERENCE], REFERENCE_STEPS, SEEDS))]
    ref = {s: rec for s, rec in ref_runs if rec is not None}
    if not ref:
        return None
    target = statistics.mean(r["final_val_loss"] for r in ref.values()) * (1 + TARGET_REL)
    systems: Dict[str, Any] = {}
    longest = 0
    for system in STUDY:
        by_budget = {}
        for budget in BUDGETS if system != REFERENCE else (REFERENCE_STEPS,):
            recs = [(r, _cached(folder, r)) for r in planned(size, [system], budget, SEEDS)]
            recs = [(run, rec) for run, rec in recs if rec is not None]
            if recs:
                by_budget[budget] = recs
        if not by_budget:
            continue
        reaching = [b for b, recs in by_budget.items()
                    if all(steps_to_target(r["val_curve"], target) is not None for _, r in recs)]
        budget = min(reaching) if reaching else max(by_budget)
        longest = max(longest, budget)
        recs = by_budget[budget]
        hits = [steps_to_target(r["val_curve"], target) for _, r in recs]
        systems[system] = {"budget": budget, "seeds": [run.seed for run, _ in recs], "steps_to_target": hits,
                           "reached": f"{sum(h is not None for h in hits)}/{len(hits)}",
                           "final_val": [r["final_val_loss"] for _, r in recs],
                           "train_s": [r.get("train_s") for _, r in recs],
                           "cpu_s": [cpu_seconds(folder, run) for run, _ in recs]}
    # the schedule control (Markdown only): dense 3D over the long budget's cosine, where trained
    control = [r for r in (_cached(folder, run) for run in planned(size, [REFERENCE], LONG_STEPS, SEEDS)) if r]
    systems[REFERENCE]["long_control"] = {"budget": LONG_STEPS, "steps_to_target": [
        steps_to_target(r["val_curve"], target) for r in control], "seeds": [r["seed"] for r in control]}
    ref_steps = [h for h in systems[REFERENCE]["steps_to_target"] if h is not None]
    for row in systems.values():
        reached = [h for h in row["steps_to_target"] if h is not None]
        row["penalty"] = statistics.mean(reached) / statistics.mean(ref_steps) if reached and ref_steps else None
    shape, corpus = model_size(size), corpus_tokens(size)
    return {"name": size, **{k: shape[k] for k in ("hidden_size", "non_embedding_params")}, "steps": REFERENCE_STEPS,
            "seeds": sorted(ref), "target": target, "tokens_per_step": shape["tokens_per_step"],
            "corpus_tokens": corpus,
            "epochs_at_longest": longest * shape["tokens_per_step"] / corpus if corpus else None,
            "systems": systems}


PUBLIC = ("steps_to_target", "reached", "penalty", "final_val")  # the per-system keys of the JSON's schema


def report(folder: Path, papers: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The JSON (issue 51's schema) and, under "_detail", what the Markdown adds (budgets, seeds, CPU seconds)."""
    import datetime

    sizes = [s for s in (size_result(name, folder) for name in SIZES) if s is not None]
    detail = {s["name"]: s["systems"] for s in sizes}
    public = [{**s, "systems": {k: {f: v[f] for f in PUBLIC} for k, v in s["systems"].items()}} for s in sizes]
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": "CPU (2 shared cores), one process and one intra-op thread per run, fp32",
            "sizes": public, "papers": list(papers), "_detail": detail}


def best_single(systems: Dict[str, Any]) -> Optional[str]:
    """The single technique that reached the target in the most seeds, then in the fewest mean steps."""
    cands = [(k, v) for k, v in systems.items() if k in SINGLE and v["penalty"] is not None]
    if not cands:
        return None
    return min(cands, key=lambda kv: (-int(kv[1]["reached"].split("/")[0]), kv[1]["penalty"]))[0]


def _cpu_file(folder: Path, run: LossRun) -> Path:
    return folder / "cpu" / f"{run.key()}_seed{run.seed}.txt"


def cpu_seconds(folder: Path, run: LossRun) -> Optional[float]:
    """The CPU seconds `train` recorded for a run (None: trained by the meter, or before they were recorded)."""
    try:
        return float(_cpu_file(folder, run).read_text())
    except (OSError, ValueError):
        return None


def _main_train(args: argparse.Namespace) -> int:
    import time

    from nanotron_ext.bench.wan.losses import train

    folder = Path(args.runs) / "losses"
    runs = planned(args.size, args.systems, args.budget, args.seeds)
    if args.jobs > 1:  # side by side: the meter's pool (no CPU seconds recorded)
        train_all(runs, folder, args.jobs)
    for run in runs:
        record = _cached(folder, run)
        if record is None:  # in this process, one at a time: its CPU seconds are this process's
            folder.mkdir(parents=True, exist_ok=True)
            t0 = time.process_time()
            record = train(run, folder / f"{run.system}_seed{run.seed}_{run.key()}.json")
            _cpu_file(folder, run).parent.mkdir(exist_ok=True)
            _cpu_file(folder, run).write_text(f"{time.process_time() - t0:.1f}\n")
        print(f"{args.size} {run.system} seed {run.seed} {record['steps']} steps: final val "
              f"{record['final_val_loss']:.4f} ({record['train_s']:.0f} s, CPU {cpu_seconds(folder, run)} s)")
    return 0


def _main_report(args: argparse.Namespace) -> int:
    from nanotron_ext.bench.wan.scales_report import PAPERS, markdown
    from nanotron_ext.fileio import write_text_atomic

    data = report(Path(args.runs) / "losses", PAPERS)
    detail = data.pop("_detail")
    out = Path(args.out)
    write_text_atomic(out, json.dumps(data, indent=1) + "\n")
    write_text_atomic(out.with_suffix(".md"), markdown(data, detail, best_single))
    print(out.with_suffix(".md").read_text())
    return 0


def rerun(result: Path, system: str, seed: int, stop_after: int) -> Dict[str, Any]:
    """Train the first `stop_after` steps of a committed meter result's loss run of `system` and `seed`, as the
    command its meta records would build it today (loss_runs of its steps, validation interval, H, --config and
    --set; the schedule over its full steps), and compare the validation loss there with the committed curve's."""
    import torch

    from nanotron_ext.config.loader import load_config
    from nanotron_ext.errors import UserFacingError
    from nanotron_ext.train.simulated import run_replicas

    saved = json.loads(result.read_text())
    meta = saved["meta"]
    committed = next((r for r in saved["runs"] if r["system"] == system and r["seed"] == seed
                      and r["steps"] == meta["steps"]), None)
    if committed is None:
        raise UserFacingError(f"{result}: no {meta['steps']}-step loss run of {system} seed {seed}")
    point = dict((int(s), v) for s, v in committed["val_curve"]).get(stop_after)
    if point is None:
        raise UserFacingError(f"--steps {stop_after}: the committed curve has no validation at that step")
    args = argparse.Namespace(config=meta["config"], steps=meta["steps"], val_every=meta["val_every"],
                              inner_steps=meta["inner_steps"], set=list(meta["set"]), tp_preset="nvlink")
    run = loss_runs([system], [seed], args)[0]
    torch.set_num_threads(1)
    cfg = load_config(run.config_file, list(run.overrides))
    ours = run_replicas(cfg, run.replicas, run.config_file, val_every=stop_after, stop_after=stop_after)["val_loss"]
    return {"system": system, "seed": seed, "step": stop_after, "committed": point, "now": ours,
            "abs_diff": abs(ours - point), "same_overrides": list(run.overrides) == committed["overrides"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.cli_checks import Writer
    from nanotron_ext.cli_flags import SEED, InputFile, Int, OutputFile, OutputFolder, Parser, one_line_refusals

    # the report is plain JSON (no marker); the one it wrote before is recognised by its keys
    writer = Writer("python -m nanotron_ext.bench.wan.scales", legacy_keys=("sizes", "papers"))
    p = Parser(prog="python -m nanotron_ext.bench.wan.scales", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (or find cached) one size's loss runs")
    t.add_argument("--size", choices=list(SIZES), required=True)
    t.add_argument("--systems", nargs="+", choices=list(SYSTEMS), required=True)
    t.add_argument("--budget", type=Int(1), choices=BUDGETS, default=REFERENCE_STEPS, help="training steps")
    t.add_argument("--seeds", type=SEED, nargs="+", default=list(SEEDS))
    t.add_argument("--jobs", type=Int(1), default=1)
    t.add_argument("--runs", type=OutputFolder(), default=RUNS)
    r = sub.add_parser("report", help="write the JSON and Markdown from the cached runs")
    r.add_argument("--runs", type=OutputFolder(), default=RUNS)
    r.add_argument("--out", type=OutputFile(writer), default="reproduce/wan/results/loss_scales.json")
    c = sub.add_parser("rerun", help="train the first steps of a committed loss run and compare its validation loss")
    c.add_argument("--result", type=InputFile(), default="reproduce/wan/results/model_clock.json")
    c.add_argument("--system", choices=list(SYSTEMS), default=REFERENCE)
    c.add_argument("--seed", type=SEED, default=1)
    c.add_argument("--steps", type=Int(1), default=20, help="stop after this step (a validation step)")

    @one_line_refusals
    def run(argv: Optional[Sequence[str]]) -> int:
        args = p.parse_args(argv)
        if args.command == "rerun":
            print(json.dumps(rerun(Path(args.result), args.system, args.seed, args.steps)))
            return 0
        return _main_train(args) if args.command == "train" else _main_report(args)

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
