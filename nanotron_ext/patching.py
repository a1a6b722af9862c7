"""Import-time check that the installed nanotron carries this repository's patch series."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"
STAMP_NAME = "NANOTRON_EXT_PATCHES"
APPLY_HINT = "run `python patches/apply.py` (or `make setup`)"


def _expected_stamp() -> str:
    spec = importlib.util.spec_from_file_location("nanotron_ext_patch_apply", PATCH_DIR / "apply.py")
    apply = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(apply)
    return apply.stamp_text()


def check_patches() -> None:
    """Raise ImportError naming the fix when nanotron is missing or unpatched."""
    spec = importlib.util.find_spec("nanotron")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nanotron is not installed: pip install nanotron==0.4, then " + APPLY_HINT)
    stamp = Path(list(spec.submodule_search_locations)[0]) / STAMP_NAME
    if not stamp.exists():
        raise ImportError(f"nanotron patches not applied to {stamp.parent}: {APPLY_HINT}")
    if not (PATCH_DIR / "apply.py").exists():
        return  # installed without the repository: the stamp's presence is all we can check
    if stamp.read_text() != _expected_stamp():
        raise ImportError(f"nanotron at {stamp.parent} carries an older patch series: {APPLY_HINT}")
