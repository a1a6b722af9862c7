"""python -m nanotron_ext.launch --nproc_per_node=N -m nanotron_ext.train --config-file X.yaml [--set key=value ...]

(plain `torchrun` works too). Exit codes: 0 done, 2 a user-facing error (one line), 130 interrupted, 1 otherwise."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import List, NoReturn, Optional

from nanotron_ext.train import failures

_STOP = {"requested": False}  # set by the handler: a library may turn the KeyboardInterrupt into another error


def _interrupt(signum: int, frame: object) -> NoReturn:
    _STOP["requested"] = True
    raise KeyboardInterrupt  # torchrun stops its workers with SIGTERM when the user presses Ctrl-C


def _interrupted(cfg: object, trainer: object) -> int:
    from nanotron_ext.train.checkpoint import latest_checkpoint

    if trainer is not None:
        last = trainer.last_checkpoint()
    else:  # stopped while starting: resume=overwrite would not resume from what is there
        last = latest_checkpoint(cfg.checkpoints.dir) if cfg is not None and cfg.checkpoints.resume == "auto" else None
    if failures.rank() == 0:  # printed, not only reported: on Ctrl-C the launcher itself is stopped too
        print(f"interrupted at step {trainer.step if trainer is not None else 0}; last complete checkpoint: "
              f"{last or 'none'}" + (" (launch again to resume from it)" if last else ""), file=sys.stderr, flush=True)
    return 130


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.config.loader import add_config_args, config_from_args
    from nanotron_ext.errors import UserFacingError

    parser = argparse.ArgumentParser(prog="python -m nanotron_ext.train", description=__doc__)
    add_config_args(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # Ctrl-C sent to the whole process group reaches workers too
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: do not outlive it
        from nanotron_ext.train.guard import exit_with_launcher

        exit_with_launcher()
    cfg = trainer = None
    try:
        cfg = config_from_args(args)
        from nanotron_ext.train.trainer import Trainer

        trainer = Trainer(cfg, config_file=args.config_file)
        trainer.train()
    except UserFacingError as e:
        return failures.report(f"error: {e}", 2)
    except OSError as e:  # a full disk, a read-only folder: the message names the file
        return failures.report(f"error: {e}; {failures.DISK_HINT}", 2)
    except KeyboardInterrupt:
        return _interrupted(cfg, trainer)
    except Exception as e:
        # Ctrl-C stops every rank at once: a collective can fail on a peer that stopped first before this
        # rank's own stop signal is handled. Let a pending signal arrive, and report the stop, not the error.
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            return _interrupted(cfg, trainer)
        if _STOP["requested"]:  # the signal came earlier and was turned into this error (torch.save's writer
            return _interrupted(cfg, trainer)  # does that), or a peer stopped while this rank sat in a collective
        line = _collective_failure(e, cfg)
        if line is None:
            raise
        return failures.report(line, 1, every_rank=True)
    finally:
        _release_process_group()
    return 0


def _collective_failure(e: Exception, cfg: object) -> Optional[str]:
    from nanotron_ext.parallel.comm import get_ledger

    timeout = cfg.general.collective_timeout_s if cfg is not None else None
    return failures.describe_collective_failure(e, get_ledger().group_name, timeout)


def _release_process_group() -> None:
    """Destroy the process group on every way out, errors included, as torch asks: an error path used to leave
    it to interpreter shutdown, and once in CI such a launch printed its error line and then aborted
    ("terminate called without an active exception", exit -6; not reproduced in isolation). Local for gloo;
    a failure here must not replace the exit code."""
    import torch.distributed as torch_dist

    try:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


if __name__ == "__main__":
    sys.exit(main())
