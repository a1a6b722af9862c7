"""python -m nanotron_ext.launch --nproc_per_node=N -m nanotron_ext.train --config-file X.yaml [--set key=value ...]

(plain `torchrun` works too). Exit codes: 0 done, 2 a user-facing error (one line), 130 interrupted, 1 otherwise."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, NoReturn, Optional

from nanotron_ext.errors import os_error_line
from nanotron_ext.train import failures

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config

_STOP = {"signal": None}  # set by the handler: a library may turn the KeyboardInterrupt into another error


def _interrupt(signum: int, frame: object) -> NoReturn:
    _STOP["signal"] = signum
    raise KeyboardInterrupt  # torchrun stops its workers with SIGTERM when the user presses Ctrl-C


def _exiting() -> None:
    """The job is on its way out (stopped, failed or done): a further SIGTERM or Ctrl-C (the launcher repeats its
    stop, the user presses Ctrl-C twice) must not raise another KeyboardInterrupt in the middle of the exit, which
    ended a stopped run with a traceback after its "interrupted" line."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _interrupted(cfg: object, trainer: object) -> int:
    from nanotron_ext.train.run_folder import stop_checkpoint

    if trainer is None and _STOP["signal"] == signal.SIGTERM:
        # the launcher stopped this rank while it was starting because a peer failed (CI saw this rank's line
        # printed before the peer's one-line error): the peer's line is the job's report, nothing to add here
        return 130
    # (stopped while starting, trainer None: resume=overwrite would not resume from what is there, but keeps it)
    note = stop_checkpoint(cfg, getattr(trainer, "folder", None)) if cfg is not None else "none"
    if failures.rank() == 0:  # printed, not only reported: on Ctrl-C the launcher itself is stopped too
        print(f"interrupted at step {trainer.step if trainer is not None else 0}; last complete checkpoint: {note}",
              file=sys.stderr, flush=True)
    return 130


def _parser() -> argparse.ArgumentParser:
    from nanotron_ext.cli_flags import Parser
    from nanotron_ext.config.loader import add_config_args

    parser = Parser(prog="python -m nanotron_ext.train", description=__doc__)
    add_config_args(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.config.loader import config_from_args
    from nanotron_ext.errors import UserFacingError

    args = _parser().parse_args(argv)
    job: dict = {}  # the trainer lives here, not in a local: _release_process_groups must be able to drop it
    stop_watchdog = None
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: do not outlive it
        # (imported before the handlers: a stop during this import ends the rank silently, not with a traceback)
        from nanotron_ext.train.guard import exit_with_launcher

        stop_watchdog = exit_with_launcher()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # Ctrl-C sent to the whole process group reaches workers too
    try:
        job["cfg"] = config_from_args(args)
        check_job_start(job["cfg"])
        from nanotron_ext.train.trainer import Trainer

        job["trainer"] = Trainer(job["cfg"], config_file=args.config_file)
        job["trainer"].train()
    except UserFacingError as e:
        return failures.report(f"error: {e}", 2)
    except OSError as e:  # a full disk, a read-only folder: the message names the file
        return failures.report(f"error: {os_error_line(e)}", 2)
    except KeyboardInterrupt:
        _exiting()
        return _interrupted(job.get("cfg"), job.get("trainer"))
    except Exception as e:
        # Ctrl-C stops every rank at once: a collective can fail on a peer that stopped first before this
        # rank's own stop signal is handled. Let a pending signal arrive, and report the stop, not the error.
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            return _interrupted(job.get("cfg"), job.get("trainer"))
        if _STOP["signal"] is not None:  # the signal came earlier and was turned into this error (torch.save's writer
            return _interrupted(job.get("cfg"), job.get("trainer"))  # does that), or a peer stopped in a collective
        line = _collective_failure(e, job.get("cfg"))
        if line is None:
            raise
        return failures.report(line, 1, every_rank=True)
    finally:
        _exiting()
        _release_process_groups(job)
        _stop_threads(stop_watchdog)
    return 0


def check_job_start(cfg: "Config") -> None:
    """What the job checks before any process group, beyond the config's own rules: model.init_from's folder (its
    config.json against the model section, its safetensors whole) and the folders the run writes (a file in the
    place of one was an OSError after start-up, reported with advice to free disk space)."""
    from nanotron_ext.cli_checks import output_folder

    if cfg.model.init_from is not None:
        from nanotron_ext.hf.folder import check_init_from  # reads the folder's config.json and tensor headers

        check_init_from(cfg.model)
    output_folder("general.output_dir", cfg.general.output_dir)
    output_folder("general.run", Path(cfg.general.output_dir) / cfg.general.run)
    output_folder("checkpoints.dir", cfg.checkpoints.dir)


def preflight(argv: List[str], world_size: Optional[int], several_hosts: bool = False) -> "Config":
    """The job's start-up checks that need neither a process group nor a model, run once by the launcher
    (python -m nanotron_ext.launch) before it starts any worker: a bad config or layout, an unwritable output
    folder, unprepared or mismatched data, or a resume with changed settings ends in about a second with the line
    each worker would print, not after N workers have imported torch and met. Raises what the worker raises (a
    UserFacingError, an OSError); the workers check everything again. `world_size` None: not known yet (elastic).
    `several_hosts` with checkpoints.storage=per_host: this host's checkpoints are left to the workers, which agree
    on them over every host (refused here, on one host, the other hosts would wait in the rendezvous). Returns the
    config."""
    from nanotron_ext.config.loader import config_from_args
    from nanotron_ext.data.loader import read_manifest
    from nanotron_ext.train.checkpoint import CheckpointError
    from nanotron_ext.train.run_folder import resume_refusal

    args = _parser().parse_args(argv)
    cfg = config_from_args(args)  # validated when built; the layout against the world size too when it is known
    if world_size is not None:  # in the worker's order: layout, folders, data, resume
        cfg.validate(world_size=world_size)
    check_job_start(cfg)
    read_manifest(cfg, args.config_file)
    if several_hosts and cfg.checkpoints.storage == "per_host":
        return cfg
    refusal = resume_refusal(cfg)
    if refusal:
        raise CheckpointError(refusal)
    return cfg


def _collective_failure(e: Exception, cfg: object) -> Optional[str]:
    from nanotron_ext.parallel.comm import get_ledger

    timeout = cfg.general.collective_timeout_s if cfg is not None else None
    return failures.describe_collective_failure(e, get_ledger().group_name, timeout)


def _release_process_groups(job: dict) -> None:
    """Destroy every process group on every way out, errors included, while the interpreter is whole.

    A clean run once ended with "terminate called without an active exception" (exit -6, no loss.png): gloo's
    C++ threads were still running at interpreter exit, because the trainer (model, optimizer, parallel context)
    kept the groups alive past destroy_process_group(). Drop it, then release the groups. Best effort: a failure
    here must not replace the exit code."""
    from nanotron_ext.parallel.context import release_process_groups

    try:
        job.clear()
        release_process_groups()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def _stop_threads(stop_watchdog: Optional[Callable[[], None]]) -> None:
    """End the threads this job started, so only the main thread reaches interpreter exit: the launcher watchdog
    and fsspec's event-loop thread (datatrove reads shards through fsspec; fsspec has no public stop, so its
    module-level loop and thread are used, best effort)."""
    if stop_watchdog is not None:
        stop_watchdog()
    try:
        from fsspec import asyn

        loop, thread = asyn.loop[0], asyn.iothread[0]
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


if __name__ == "__main__":
    sys.exit(main())
