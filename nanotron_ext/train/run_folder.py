"""One launch's run folder (general.output_dir/general.run) and checkpoint folder (checkpoints.dir): locked for
the process's life, where the run's records go, the checkpoint it resumes from, the checkpoints it writes, and
the one resume hint every stop names.

`RunFolder(cfg, agree)` claims both folders (rank 0; every rank learns the verdict): a busy folder, or
checkpoints that resume=never would overwrite, stop the launch before any model is built. An interrupted
overwrite handover is recovered first (train/handover.py); with resume=overwrite the records go to a staging
folder until this run's first checkpoint hands the run folder over. `start` then loads the checkpoint to resume
from (checkpoints.resume=auto) and writes config.yaml when there is training left.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch.distributed as torch_dist

from nanotron_ext.config.loader import config_to_dict, save_config
from nanotron_ext.config.schema import Config
from nanotron_ext.errors import TrainingError, os_error_line
from nanotron_ext.train.agreement import RankAgreement, gather_objects, gather_or_raise, host_index
from nanotron_ext.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from nanotron_ext.train.checkpoint_hosts import CheckpointHosts, agreed_checkpoint
from nanotron_ext.train.checkpoint_store import damaged_after, kept_note, resume_hint
from nanotron_ext.train.guard import (
    claim_checkpoint_folder,
    claim_folders,
    remove_other_checkpoints,
    resume_advice,
    resume_conflict,
)
from nanotron_ext.train.handover import STAGING, begin, complete, recover

if TYPE_CHECKING:
    from nanotron.parallel import ParallelContext

    from nanotron_ext.train.replica import Replica

logger = logging.getLogger(__name__)


def stop_checkpoint(cfg: Config, folder: Optional["RunFolder"]) -> str:
    """The end of a stopped launch's line, after "last complete checkpoint: ": the checkpoint a relaunch resumes
    from, or none of this run and the earlier run's kept (resume=overwrite), or none. `folder`: the launch's run
    folder, None when it stopped before claiming it."""
    if folder is not None:
        last, earlier = folder.last_checkpoint(), folder.earlier_checkpoint()
    else:  # (the complete one a relaunch would read: a damaged newer one is said by the relaunch)
        last = latest_checkpoint(cfg.checkpoints.dir) if cfg.checkpoints.resume == "auto" else None
        earlier = latest_checkpoint(cfg.checkpoints.dir) if cfg.checkpoints.resume == "overwrite" else None
    if last:
        return f"{last} (launch again to resume from it)"
    if earlier:
        return f"none of this run; {kept_note(earlier)}"
    return "none"


def checkpoint_to_resume(cfg: Config) -> Optional[Path]:
    """The checkpoint a launch of `cfg` resumes from: the newest complete one with checkpoints.resume=auto. A newer
    step_<N> folder that is damaged (its meta.json unreadable or malformed) is refused: the launch would start
    before it and replace it when it reaches step N (it used to be skipped with only a warning)."""
    if cfg.checkpoints.resume != "auto":
        return None
    root = Path(cfg.checkpoints.dir)
    skipped: List[Tuple[int, Path, str]] = []
    found = list_checkpoints(root, skipped)
    damaged = damaged_after(found, skipped)
    if damaged is not None:
        start = f"from {found[-1][1]}" if found else "afresh"
        raise CheckpointError(f"checkpoints.dir {root}: {damaged[1].name} is damaged ({damaged[2]}): this run would "
                              f"start {start} and replace it at step {damaged[0]}; move {damaged[1]} out of {root} "
                              "to resume from the one before (or start with checkpoints.resume=overwrite)")
    return found[-1][1] if found else None


def resume_refusal(cfg: Config) -> Optional[str]:
    """Why a launch of `cfg` must not resume (resume_conflict of the checkpoint it would resume from), read
    without touching the folders: None also while an interrupted overwrite handover waits for the next launch's
    rank 0 to finish or undo it (which may change the checkpoint to resume from). The launcher's pre-flight."""
    if (Path(cfg.general.output_dir) / cfg.general.run / STAGING).is_dir():
        return None
    ckpt = checkpoint_to_resume(cfg)
    return resume_conflict(ckpt, config_to_dict(cfg)) if ckpt is not None else None


class RunFolder:
    def __init__(self, cfg: Config, agree: RankAgreement) -> None:
        self.cfg, self.agree = cfg, agree
        self.run_dir = Path(cfg.general.output_dir) / cfg.general.run
        # where this run's records go: the run folder, or (resume=overwrite, rank 0) a staging folder in it until
        # the first checkpoint hands the run folder over (train/handover.py)
        self.records_dir = self.run_dir
        self._saved_here: List[Path] = []  # checkpoints this launch wrote
        # resume=overwrite: the earlier checkpoints are deleted once this run's first one is complete, not before
        self._overwrite_pending = cfg.checkpoints.resume == "overwrite"
        # which rank handles which checkpoint folder (checkpoints.storage=per_host: each host's own disk; set by _claim)
        self.hosts: Optional[CheckpointHosts] = None
        self._locks = self._claim()
        # agreed before the model is built: a host's refusal reaches every host within seconds (collective)
        self._resume_from = self._agreed_resume()

    def _claim(self) -> list:
        """Rank 0 locks the run and checkpoint folders for this process's life (with checkpoints.storage=per_host
        each other host's first rank its own checkpoint folder); every rank learns the verdict. A job over several
        hosts with storage=shared is refused when a host does not see rank 0's checkpoint folder."""
        locks, error = [], None
        nodes = gather_objects(host_index(), self.agree.world_pg)
        rank = torch_dist.get_rank(self.agree.world_pg)
        self.hosts = CheckpointHosts.of(nodes, self.cfg.checkpoints.storage == "per_host", rank)
        if self.hosts.is_leader and not self.agree.is_main:
            try:
                locks = claim_checkpoint_folder(Path(self.cfg.checkpoints.dir), self.cfg.checkpoints.resume)
            except TrainingError as e:
                error = f"node {nodes[rank]}: {e}"
            except OSError as e:
                error = f"node {nodes[rank]}: {os_error_line(e)}"
        if self.agree.is_main:
            try:
                ckpt_dir = Path(self.cfg.checkpoints.dir)
                locks = claim_folders(self.run_dir, ckpt_dir, self.cfg.checkpoints.resume)
                note = recover(self.run_dir, ckpt_dir)  # before anything reads the checkpoints
                if note:
                    print(note, flush=True)
                if self.cfg.checkpoints.resume == "overwrite":
                    self.records_dir = begin(self.run_dir, ckpt_dir)
            except TrainingError as e:
                error = str(e)
            except OSError as e:  # a folder that cannot be created or written: every rank stops with the line
                error = os_error_line(e)
        gather_or_raise(error, self.agree.world_pg, lambda failed: TrainingError(failed[0][1]))
        if not self.hosts.per_host and len(set(nodes)) > 1:
            self._check_shared(nodes)
        return locks

    def _check_shared(self, nodes: List[int]) -> None:
        """storage=shared over several hosts: every host must see the checkpoint folder rank 0 locked (a folder of
        the same name on each host's own disk would give each host a part of every checkpoint, none resumable)."""
        probe = Path(self.cfg.checkpoints.dir) / ".lock"
        token = gather_objects(probe.stat().st_ino if self.agree.is_main else None, self.agree.world_pg)[0]
        seen = probe.is_file() and probe.stat().st_ino == token
        blind = sorted({n for n, ok in zip(nodes, gather_objects(seen, self.agree.world_pg)) if not ok})
        if blind:
            raise TrainingError(f"checkpoints.dir {self.cfg.checkpoints.dir} is not shared by every host: node "
                                f"{', '.join(map(str, blind))} does not see node {nodes[0]}'s folder (checkpoints."
                                "storage=shared); mount one file system on every host, or set checkpoints.storage="
                                "per_host (each host keeps its own ranks' shards)")

    def _agreed_resume(self) -> Optional[Path]:
        """The checkpoint every rank resumes from (collective), its settings checked on every rank: with
        checkpoints.storage=per_host each host reads its own copy, and one host's refusal is every host's."""
        ckpt = agreed_checkpoint(self.cfg.checkpoints.dir, self.agree.world_pg, self.hosts,
                                 lambda: checkpoint_to_resume(self.cfg))
        if ckpt is None:
            return None
        conflict = resume_conflict(ckpt, config_to_dict(self.cfg))
        if conflict and self.hosts.per_host:
            conflict = f"node {self.hosts.host}: {conflict}"
        gather_or_raise(conflict, self.agree.world_pg, lambda failed: CheckpointError(failed[0][1]))
        return ckpt

    def start(self, ctx: "ParallelContext", replica: "Replica",
              restore: Callable[[Path, Dict[str, object]], int]) -> int:
        """The step this launch starts from (collective): 0, or that of the checkpoint to resume from, loaded
        into `replica`'s model, optimiser and schedule and handed to `restore` (the rest of the saved state; it
        returns the step). config.yaml is written only once that succeeded and there is training left to do: a
        launch that fails, or finds the run complete, leaves the run folder as it was."""
        step = 0
        ckpt = self._resume_from
        if ckpt is not None:
            config = config_to_dict(self.cfg)
            try:
                extra = load_checkpoint(ckpt, ctx, model=replica.model, optimizer=replica.optimizer,
                                        scheduler=replica.scheduler)
                step = restore(ckpt, extra)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; {resume_advice(ckpt, config)}") from None
            if self.agree.is_main:
                print(f"resumed from {ckpt} at step {step}")
        if step < self.cfg.tokens.train_steps:
            self.agree.on_main(lambda: save_config(self.cfg, self.records_dir / "config.yaml"))
        return step

    def save(self, step: int, ctx: "ParallelContext", replica: "Replica", extra: Dict[str, object]) -> Path:
        """Checkpoint `step` (collective): `replica`'s model, optimiser and schedule and `extra`. This run's first
        one ends a resume=overwrite: the earlier checkpoints are deleted and the records change owner with them."""
        path = save_checkpoint(
            self.cfg.checkpoints.dir, step, ctx, model=replica.model, optimizer=replica.optimizer,
            scheduler=replica.scheduler, extra=extra, keep_last=self.cfg.checkpoints.keep_last,
            config=config_to_dict(self.cfg), hosts=self.hosts,
        )
        self._saved_here.append(path)
        if self._overwrite_pending:  # this run has a complete checkpoint of its own now
            if self.agree.is_main:
                remove_other_checkpoints(Path(self.cfg.checkpoints.dir), path)
            self._overwrite_pending = False
        if self.records_dir != self.run_dir:  # rank 0 of an overwrite: the records change owner with the checkpoints
            try:
                complete(self.run_dir, Path(self.cfg.checkpoints.dir))
                self.records_dir = self.run_dir
            except OSError as e:  # the next checkpoint, or the next launch, finishes it
                logger.warning("checkpoints.resume=overwrite: could not yet put this run's records in %s: %s",
                               self.run_dir, e)
        return path

    def set_aside(self, step: int) -> Optional[Path]:
        """Move this launch's checkpoint of `step` (whose weights just gave a diverged loss) out of the resume
        namespace, kept as step_N.diverged; None when this launch did not write one."""
        bad = Path(self.cfg.checkpoints.dir) / f"step_{step}"
        if bad not in self._saved_here:
            return None
        if self.hosts.is_leader:
            target = bad.with_name(f"{bad.name}.diverged")
            if target.exists():
                remove_checkpoint(target)
            os.replace(bad, target)
        return bad

    def last_checkpoint(self, exclude: Optional[Path] = None) -> Optional[Path]:
        """This run's newest complete checkpoint but `exclude` (with resume=overwrite the earlier run's, not yet
        deleted, do not count)."""
        if self._overwrite_pending:
            return None
        found = [p for _, p in list_checkpoints(self.cfg.checkpoints.dir) if p != exclude]
        return found[-1] if found else None

    def earlier_checkpoint(self) -> Optional[Path]:
        """With resume=overwrite before this run's first checkpoint: the earlier run's newest, still kept."""
        return latest_checkpoint(self.cfg.checkpoints.dir) if self._overwrite_pending else None

    def resume_hint(self, exclude: Optional[Path] = None) -> str:
        return resume_hint(self.cfg.checkpoints.dir, self.last_checkpoint(exclude), self.earlier_checkpoint())
