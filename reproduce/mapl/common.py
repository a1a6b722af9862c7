"""What the MAPL scripts share: the CPU-scale run of one design and seed, and the analysis of its final
checkpoint (nanotron_ext.mapl.analyse: energy kept, rank for 99% energy, pair-cosine Pearson r, principal
angles, distance from the Stiefel manifold).

Runs go to runs/mapl_findings/<name>_s<seed>/ through the shared trainer harness (bench.training), which
reuses a finished run of exactly the same resolved config: the manifold ablation and the findings
script share their SPEL runs.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.bench import presets
from nanotron_ext.bench.launch import last_error_line, launch
from nanotron_ext.bench.training import latest_checkpoint_of, run_training

CPU_CONFIG = "reproduce/mapl/cpu_small.yaml"
GPU_CONFIG = "reproduce/mapl/mapl_1b.yaml"  # the largest of the paper's sizes on one 80 GB GPU, P simulated
# sending layers of P stages simulated as codec boundaries: over the CPU config's 8 layers, the 1B model's 16
BOUNDARIES = {4: "[1, 3, 5]", 8: "every_layer"}
GPU_BOUNDARIES = {4: "[3, 7, 11]", 8: "[1, 3, 5, 7, 9, 11, 13]"}
ROOT = Path("runs/mapl_findings")
P8 = ["model.codec.kind=mapl", f"model.codec.boundaries={BOUNDARIES[8]}"]
# Muon's orthogonalisation in fp32: the same iteration, 5-20x faster than bf16 on CPUs (optimizer.muon_ns_dtype)
CPU_FAST = ["optimizer.muon_ns_dtype=fp32"]
# the manifold ablation's rows (optimizer.spel.mode); "spel" is also the findings script's run
ROWS: Dict[str, List[str]] = {
    "uncompressed": ["model.codec.kind=identity"],
    "spel": [*P8, "optimizer.spel.mode=stiefel"],
    "fixed": [*P8, "optimizer.spel.mode=fixed"],
    "euclidean": [*P8, "optimizer.spel.mode=euclidean"],
    "euclidean_qr": [*P8, "optimizer.spel.mode=euclidean_qr"],
}


def row_runs(rows: Sequence[str], seeds: Sequence[int], args: Any) -> Dict[str, Tuple[str, List[str]]]:
    """'<row> seed <s>' -> (config, overrides), single process (P stages simulated as codec boundaries).
    CPU preset: `args.config_file` for `args.steps` steps with fp32 Muon orthogonalisation; GPU preset
    (`args.preset == "gpu"`): the 1B config with P = 8 over its 16 layers, bf16, on `args.data`."""
    gpu = getattr(args, "preset", "cpu") == "gpu"
    out = {}
    for seed in seeds:
        for row in rows:
            ovr = list(ROWS[row])
            if gpu:
                ovr = [o.replace(f"boundaries={BOUNDARIES[8]}", f"boundaries={GPU_BOUNDARIES[8]}") for o in ovr]
                ovr += [*presets.gpu_overrides(args), "parallelism.pp=1"]
            else:
                ovr += [*CPU_FAST, f"tokens.train_steps={args.steps}"]
            out[f"{row} seed {seed}"] = (GPU_CONFIG if gpu else args.config_file,
                                         [*ovr, *args.set, f"general.seed={seed}"])
    return out


def train(key: str, config: str, overrides: Sequence[str], torchrun_args: Sequence[str] = ()) -> Dict[str, Any]:
    """One run of `row_runs` ('<row> seed <s>'); a finished run of the same resolved config is reused (so
    both scripts share the SPEL runs)."""
    row, seed = key.split(" seed ")
    return run_training(config, overrides, f"ablation_{row}_s{seed}", root=ROOT, torchrun_args=torchrun_args,
                        reuse=True, timeout_s=48 * 3600)


def _cached_analysis(out: Path) -> Optional[Dict[str, Any]]:
    """mapl.analyse's result at `out` (rows: a list of objects, meta: an object, every number finite), or None
    when it is damaged: said in one line on stderr (the caller analyses again)."""
    from nanotron_ext.cli_checks import ArgumentError, JsonFile
    from nanotron_ext.plan.cached import first_non_finite

    f = JsonFile(out, "MAPL analysis cache", advice="analysing again")
    try:
        saved = f.read_object()
        if any(not isinstance(r, dict) for r in f.need(saved, "rows", list)):
            f.fail("rows is not a list of objects")
        f.need(saved, "meta", dict)
        bad = first_non_finite(saved, "")
        if bad:
            f.fail(f"{bad}, not a finite number")
        return saved
    except ArgumentError as e:
        print(e, file=sys.stderr)
        return None


def analyse(summary: Dict[str, Any], batches: int = 8) -> Dict[str, Any]:
    """mapl.analyse on the run's final checkpoint ({"boundaries": [...], "meta": {...}}); cached beside the
    run and redone when the run is newer or the cached one is damaged."""
    run_dir = Path(summary["run_dir"])
    out = run_dir / "mapl_analysis.json"
    fresh = out.exists() and out.stat().st_mtime >= (run_dir / "summary.json").stat().st_mtime
    saved = _cached_analysis(out) if fresh else None
    if saved is None:
        ckpt = latest_checkpoint_of(summary)
        args = ["--config-file", str(run_dir / "config.yaml"), "--checkpoint", str(ckpt), "--batches", str(batches),
                "--out", str(out)]
        rc, tail = launch("nanotron_ext.mapl.analyse", args, ["--standalone", "--nproc_per_node", "1", "-m"],
                          run_dir / "mapl_analysis.log", timeout_s=1800)
        if rc != 0:
            raise RuntimeError(f"mapl.analyse of {run_dir} failed (rc {rc}): {last_error_line(tail)}")
        saved = _cached_analysis(out)
        if saved is None:
            raise RuntimeError(f"mapl.analyse of {run_dir} wrote no readable {out} (said above)")
    return {"boundaries": saved["rows"], "meta": saved["meta"]}


def boundary_mean(analysis: Dict[str, Any], key: str) -> float:
    rows: List[Dict[str, Any]] = analysis["boundaries"]
    return sum(float(r[key]) for r in rows) / len(rows)
