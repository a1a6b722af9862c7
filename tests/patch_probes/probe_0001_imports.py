"""0001: every nanotron module nanotron_ext uses imports first in a fresh interpreter.

Import cycles depend on which module is imported first, so each module gets its own forked
interpreter (torch is imported once, before forking, to keep this fast).
"""
from __future__ import annotations

import os
import sys
import traceback

import torch  # noqa: F401  (shared by the forked children)

MODULES = [
    "nanotron.logging",
    "nanotron.config",
    "nanotron.models",
    "nanotron.parallel.parameters",
    "nanotron.parallel.tensor_parallel.nn",
    "nanotron.parallel.tensor_parallel.functional",
    "nanotron.parallel.pipeline_parallel.block",
    "nanotron.parallel.pipeline_parallel.p2p",
    "nanotron.parallel.pipeline_parallel.engine",
    "nanotron.parallel.pipeline_parallel.utils",
    "nanotron.optim.gradient_accumulator",
]


def import_in_child(module: str) -> bool:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            __import__(module)
            sys.path.insert(0, os.path.dirname(__file__))
            from _common import check_origin

            check_origin()
        except BaseException:  # noqa: BLE001 - report and exit non-zero
            print(f"IMPORT {module} FAILED\n{traceback.format_exc()}", flush=True)
            code = 1
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


if __name__ == "__main__":
    results = {m: import_in_child(m) for m in MODULES}
    for module, ok in results.items():
        print(f"IMPORT {module} {'ok' if ok else 'FAILED'}")
    sys.exit(0 if all(results.values()) else 1)
