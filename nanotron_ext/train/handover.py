"""checkpoints.resume=overwrite hands the run folder to the new run at one moment: its first complete checkpoint.

Until then the new run's records (config.yaml, metrics.jsonl, tensorboard/, summary.json, loss.png) are written
to `<run_dir>/.overwrite/`, beside `claim.json`, which names the earlier run's checkpoints (the sha256 of each
meta.json); the earlier run's checkpoints and records are not touched, so a launch that ends before its first
checkpoint leaves the earlier run whole. At that checkpoint `complete` deletes the earlier checkpoints, sets the
earlier records aside, puts the new ones in their place and deletes what was set aside. Every launch first
`recover`s an interrupted handover: a staging folder whose run has a checkpoint is completed, one without is
discarded (its run owns nothing: there is no checkpoint to resume it from).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

from nanotron_ext.fileio import sha256_file, write_text_atomic
from nanotron_ext.train.checkpoint_store import META_NAME, list_checkpoints, remove_checkpoint

logger = logging.getLogger(__name__)

STAGING = ".overwrite"
CLAIM = "claim.json"
EARLIER = "earlier"  # inside STAGING: the earlier run's records, set aside during `complete`
RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "loss.png", "tensorboard")


def _fingerprints(checkpoint_dir: Path) -> Dict[str, str]:
    return {p.name: sha256_file(p / META_NAME) for _, p in list_checkpoints(checkpoint_dir)}


def begin(run_dir: Path, checkpoint_dir: Path) -> Path:
    """The folder the overwriting run writes its records to: `run_dir` when there is no earlier run to keep
    (no checkpoint, no record), else a fresh staging folder. Call after `recover`, holding the run's lock."""
    earlier = _fingerprints(checkpoint_dir)
    if not earlier and not any((run_dir / r).exists() for r in RECORDS):
        return run_dir
    staging = run_dir / STAGING
    staging.mkdir()
    write_text_atomic(staging / CLAIM, json.dumps({"phase": "training", "earlier": earlier}, indent=2) + "\n")
    return staging


def _claim(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / STAGING / CLAIM).read_text())
    except (OSError, ValueError):
        return None  # no claim was written (a crash right after mkdir): nothing was staged under it


def recover(run_dir: Path, checkpoint_dir: Path) -> Optional[str]:
    """Finish or undo a handover an earlier launch left (see the module doc); returns a line saying which."""
    staging = run_dir / STAGING
    if not staging.is_dir():
        return None
    claim = _claim(run_dir)
    earlier = set((claim or {}).get("earlier", {}).values())
    owned = claim is not None and any(f not in earlier for f in _fingerprints(checkpoint_dir).values())
    if owned:
        complete(run_dir, checkpoint_dir)
        return f"completed the checkpoints.resume=overwrite handover of {run_dir} that a stopped launch began"
    shutil.rmtree(staging)
    return (f"discarded {staging}: the records of a checkpoints.resume=overwrite launch that ended before its first "
            f"checkpoint (the earlier run in {run_dir} was kept)")


def complete(run_dir: Path, checkpoint_dir: Path) -> None:
    """The new run has a complete checkpoint: it owns the folders now. Safe to repeat after a crash at any point."""
    staging = run_dir / STAGING
    claim = _claim(run_dir)
    if claim is None:
        return
    earlier = set(claim["earlier"].values())
    for _, path in list_checkpoints(checkpoint_dir):
        if sha256_file(path / META_NAME) in earlier:
            remove_checkpoint(path)
    aside = staging / EARLIER
    if claim["phase"] == "training":  # nothing of the new run is in run_dir yet: all there is the earlier run's
        aside.mkdir(exist_ok=True)
        for name in RECORDS:
            if (run_dir / name).exists():
                os.replace(run_dir / name, aside / name)
        claim["phase"] = "installing"
        write_text_atomic(staging / CLAIM, json.dumps(claim, indent=2) + "\n")
    for name in RECORDS:
        if (staging / name).exists():
            os.replace(staging / name, run_dir / name)
    shutil.rmtree(staging)
