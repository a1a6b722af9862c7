"""Learning curves for the model clock (`--clock model`): each system trained in its cheapest equivalent layout.

Losses do not depend on links, so one set of loss runs serves every preset, and nothing here is timed. A system's
real layout (dp x tp x pp over emulated links) is replaced by one process that computes the same function:

- tp = 1: Megatron TP, vanilla TP and BOOST's BTP are exact re-shardings of the same model (tests/test_parallel_parity
  and the BOOST tests hold them to a float64 reference);
- pp = 1 with the codec at the real layout's stage boundaries (`model.codec.boundaries` = the sending layers): the
  encoder and decoder of a boundary are the same modules whether the wire crosses a process or not;
- dp replicas simulated in this process (`train.simulated.run_replicas`): per-step gradient averaging ("dense")
  for an all-reduce DP tier, the outer loop the DP sync's technique builds for in-process replicas otherwise
  (SparseLoCo's `SimulatedReplicas`), each replica on the data shard the trainer gives its DP rank and with its
  own codec (heterogeneous SparseLoCo).

Each equivalence is a test (tests/test_wan_losses.py: the real layout's first steps against the cheap one's).
Runs train `--jobs` at a time (at most the cores: one intra-op thread each), each writes its curve to
`<runs>/<system>_seed<seed>_<key>.json`; a finished file of the same resolved config is read back (checked: a
damaged one is said in one line and trained again), so systems whose cheap layouts coincide (three tiers and its
dense-TP twin differ only in TP) train once, and an interrupted batch resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.cli_checks import JsonFile
from nanotron_ext.config.digest import digest
from nanotron_ext.errors import UserFacingError

CHEAP_KEYS = ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.link.enabled=false")


@dataclasses.dataclass(frozen=True)
class LossRun:
    """One learning curve: a system's cheap layout (config + overrides), its replicas and DP mode, and a seed."""

    system: str
    seed: int
    config_file: str
    overrides: Tuple[str, ...]
    replicas: int
    mode: str  # "dense" (a per-step gradient average) or "sparseloco" (the outer loop)
    val_every: int

    def key(self) -> str:
        """A digest of everything the curve depends on: the resolved config, the replicas and the mode."""
        from nanotron_ext.config.loader import config_to_dict, load_config

        resolved = config_to_dict(load_config(self.config_file, list(self.overrides)))
        # keys that do not change the math (general.step_guard: where the guard's verdict is read, the same losses:
        # tests/test_step_guard.py; where checkpoints go; what is logged), so runs trained before them keep their key
        for volatile in ("general.run", "general.output_dir", "logging.progress_bar", "general.step_guard",
                         "checkpoints.storage", "logging.rank_cpu_seconds"):
            section, name = volatile.split(".")
            resolved.get(section, {}).pop(name, None)
        return digest([resolved, self.replicas, self.mode, self.val_every], 12)


def cheap_layout(config_file: str | Path, overrides: Sequence[str]) -> Tuple[List[str], int, str]:
    """(overrides, replicas, mode) of the one-process layout that trains the same function as `config_file` +
    `overrides` (the module docstring)."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.parallel.layout import codec_boundaries, split_layers

    real = load_config(config_file, list(overrides))
    p, m = real.parallelism, real.model
    boundaries = codec_boundaries(m.codec.boundaries, split_layers(m.num_layers, p.pp))
    sets = [*overrides, *CHEAP_KEYS, f"model.codec.boundaries=[{','.join(map(str, boundaries))}]"]
    return sets, p.dp, "sparseloco" if p.dp_sync == "sparseloco" else "dense"


def train(run: LossRun, out: Path) -> Dict[str, Any]:
    """Train `run` (in this process, one intra-op thread) and write its curve to `out` atomically."""
    import torch

    from nanotron_ext.config.loader import load_config
    from nanotron_ext.fileio import write_text_atomic
    from nanotron_ext.train.simulated import run_replicas

    torch.set_num_threads(1)
    cfg = load_config(run.config_file, list(run.overrides))
    t0 = time.perf_counter()
    result = run_replicas(cfg, run.replicas, run.config_file, val_every=run.val_every)  # the DP sync's outer loop
    record = {"system": run.system, "seed": run.seed, "key": run.key(), "config_file": run.config_file,
              "overrides": list(run.overrides), "replicas": run.replicas, "mode": run.mode,
              "steps": cfg.tokens.train_steps, "val_every": run.val_every, "train_loss": result["train_loss"],
              "val_curve": result["val_curve"], "final_val_loss": result["val_loss"],
              "sync_payload_bytes": result["sync_bytes"][:1], "train_s": time.perf_counter() - t0}
    write_text_atomic(out, json.dumps(record) + "\n")
    return record


def _file(folder: Path, run: LossRun, key: str) -> Path:
    return folder / f"{run.system}_seed{run.seed}_{key}.json"


class DamagedLossRun(UserFacingError):
    """A loss-run file that is not what `train` writes."""


def read_finished(path: Path, key: str) -> Optional[Dict[str, Any]]:
    """The curve `train` wrote at `path` for `key`, checked (every number finite, the keys the meter reads of their
    kinds), or None when it is another config's or damaged: a damaged one is said in one line on stderr and
    trained again (written over)."""
    from nanotron_ext.plan.cached import first_non_finite

    f = JsonFile(path, "loss-run cache", DamagedLossRun, "training it again")
    try:
        record = f.read_object()
        if f.need(record, "key", str) != key:
            return None  # a file of another config whose name holds this key as a part
        bad = first_non_finite(record, "")
        if bad:
            f.fail(f"{bad}, not a finite number")
        f.number(record, "final_val_loss")
        f.number(record, "seed")
        curve = f.need(record, "val_curve", list)
        if not curve or any(not isinstance(p, list) or len(p) != 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in p) for p in curve):
            f.fail("val_curve is not a non-empty list of [step, loss] pairs")
        f.need(record, "train_loss", list)
        return record
    except DamagedLossRun as e:
        print(e, file=sys.stderr)
        return None


def finished(folder: Path, key: str, seed: int) -> Optional[Dict[str, Any]]:
    """A finished curve of the same resolved config and seed, whichever system trained it (read_finished)."""
    for path in sorted(folder.glob(f"*_seed{seed}_{key}.json")):
        record = read_finished(path, key)
        if record is not None:
            return record
    return None


def train_all(runs: Sequence[LossRun], folder: Path, jobs: int) -> List[Dict[str, Any]]:
    """Every run's curve, in order: read back when finished before (any system's file with the same key and seed),
    else trained `jobs` at a time (never more than the cores)."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    keys = [r.key() for r in runs]
    results: Dict[int, Dict[str, Any]] = {}
    todo: Dict[Tuple[str, int], List[int]] = {}
    for i, (run, key) in enumerate(zip(runs, keys)):
        done = finished(folder, key, run.seed)
        if done is not None:
            results[i] = {**done, "system": run.system}
        else:
            todo.setdefault((key, run.seed), []).append(i)
    workers = max(1, min(jobs, os.cpu_count() or 1, len(todo) or 1))
    if todo:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("forkserver")) as pool:
            futures = {pool.submit(train, runs[ids[0]], _file(folder, runs[ids[0]], key)): ids
                       for (key, _), ids in todo.items()}
            for future in tqdm(as_completed(futures), total=len(futures), desc="loss runs", unit="run"):
                record = future.result()
                for i in futures[future]:
                    results[i] = {**record, "system": runs[i].system}
    return [results[i] for i in range(len(runs))]


def loss_runs(systems: Sequence[str], seeds: Sequence[int], args: Any) -> List[LossRun]:
    """The loss runs of `systems` x `seeds` under the meter's budget (`args`: steps, val_every, inner_steps, set)."""
    from nanotron_ext.bench.wan.systems import run_overrides, system_config

    out = []
    for system in systems:
        config = str(system_config(system, args))
        for seed in seeds:
            sets, replicas, mode = cheap_layout(config, run_overrides(system, None, seed, args))
            out.append(LossRun(system, seed, config, tuple(sets), replicas, mode, args.val_every))
    return out
