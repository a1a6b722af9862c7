"""Shared set-up for the patch probes (scripts run by tests/test_patches.py, one per patch).

A probe imports only torch and nanotron, so that PYTHONPATH decides which copy of nanotron
(patched, or with one patch reversed) it exercises; it exits 0 when the patched behaviour holds.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, List


def check_origin() -> None:
    """Fail loudly if nanotron was not imported from the copy the test meant to probe."""
    import nanotron

    root = os.environ["NANOTRON_PROBE_ROOT"]
    if not os.path.realpath(nanotron.__file__).startswith(os.path.realpath(root) + os.sep):
        raise SystemExit(f"probe imported nanotron from {nanotron.__file__}, expected a copy under {root}")


def init_gloo() -> None:
    """Plain torch.distributed gloo init from the torchrun-style environment, bypassing nanotron."""
    import torch.distributed as torch_dist

    torch_dist.init_process_group(
        "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


def run_checks(checks: List[Callable[[], None]]) -> None:
    """Run every check (each is expected to fail on its own), print each failure, exit 1 if any failed."""
    failed = 0
    for check in checks:
        try:
            check()
            print(f"CHECK {check.__name__} passed", flush=True)
        except Exception:  # noqa: BLE001 - a probe reports every failing behaviour, not just the first
            failed += 1
            print(f"CHECK {check.__name__} FAILED\n{traceback.format_exc()}", flush=True)
    finish(failed)


def finish(failed: int) -> None:
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        if not failed:
            torch_dist.barrier()
        torch_dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if failed else 0)
