"""Each patch in patches/series is needed, and patches/apply.py applies the series correctly.

For every patch, a probe script (tests/patch_probes/) exercises the behaviour the patch fixes.
It runs in a fresh interpreter whose PYTHONPATH points at a temporary copy of the installed
nanotron: the fully patched copy must pass, and a copy with exactly that one patch reversed
(`patch -p1 -R`) must fail with the defect's own error. The applier tests run apply.py on a
pristine copy rebuilt by reversing the whole series, checked file by file against the wheel's
RECORD hashes, so no download or pip cache is needed.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"
PROBE_DIR = Path(__file__).resolve().parent / "patch_probes"
STAMP_NAME = "NANOTRON_EXT_PATCHES"
SERIES: List[str] = [
    line.strip()
    for line in (PATCH_DIR / "series").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def _patch_named(number: str) -> str:
    (name,) = [p for p in SERIES if p.startswith(number + "-")]
    return name


# --------------------------------------------------------------------------------------------
# Copies of the installed nanotron
# --------------------------------------------------------------------------------------------
def installed_site_packages() -> Path:
    """The directory holding the installed `nanotron` package (found without importing it)."""
    spec = importlib.util.find_spec("nanotron")
    assert spec is not None and spec.submodule_search_locations, "nanotron is not installed"
    return Path(list(spec.submodule_search_locations)[0]).parent


def copy_nanotron(dest_root: Path) -> Path:
    """Copy the installed package (sources only) to dest_root/nanotron; returns dest_root."""
    dest_root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        installed_site_packages() / "nanotron", dest_root / "nanotron", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest_root


def patch_cmd(root: Path, patch_name: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = ["patch", "-p1", "-s", "-f", "--no-backup-if-mismatch", "-d", str(root), "-i",
           str(PATCH_DIR / patch_name), *flags]
    return subprocess.run(cmd, capture_output=True, text=True)


def reverse(root: Path, patch_name: str) -> None:
    result = patch_cmd(root, patch_name, "-R")
    assert result.returncode == 0, f"reversing {patch_name} failed:\n{result.stdout}{result.stderr}"
    assert not list(root.rglob("*.rej")) and not list(root.rglob("*.orig"))


def record_hashes() -> Dict[str, str]:
    """{path: sha256 (urlsafe b64, as in RECORD)} for nanotron's files, from the wheel's RECORD."""
    (dist_info,) = installed_site_packages().glob("nanotron-0.4.dist-info")
    hashes = {}
    for line in (dist_info / "RECORD").read_text().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path.startswith("nanotron/") and digest.startswith("sha256="):
            hashes[path] = digest[len("sha256="):]
    return hashes


def file_hash(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def tree_hashes(root: Path) -> Dict[str, str]:
    return {
        p.relative_to(root).as_posix(): file_hash(p)
        for p in (root / "nanotron").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def expected_stamp() -> str:
    spec = importlib.util.spec_from_file_location("nanotron_ext_patch_apply", PATCH_DIR / "apply.py")
    apply = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(apply)
    return apply.stamp_text()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nanotron_patches_"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def patched_root(workdir: Path) -> Path:
    """A copy of the installed, fully patched nanotron."""
    root = copy_nanotron(workdir / "patched")
    stamp = root / "nanotron" / STAMP_NAME
    assert stamp.exists() and stamp.read_text() == expected_stamp(), (
        "the installed nanotron does not carry the current patch series: python patches/apply.py"
    )
    return root


@pytest.fixture(scope="module")
def pristine_root(workdir: Path) -> Path:
    """nanotron==0.4 as the wheel ships it: the whole series reversed, stamp removed."""
    root = copy_nanotron(workdir / "pristine")
    for name in reversed(SERIES):
        reverse(root, name)
    (root / "nanotron" / STAMP_NAME).unlink()
    return root


@pytest.fixture(scope="module")
def without_patch(workdir: Path):
    """without_patch("0003") -> a fully patched copy with only that patch reversed (cached)."""
    cache: Dict[str, Path] = {}

    def make(number: str) -> Path:
        if number not in cache:
            root = copy_nanotron(workdir / f"without-{number}")
            reverse(root, _patch_named(number))
            cache[number] = root
        return cache[number]

    return make


# --------------------------------------------------------------------------------------------
# Running a probe
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ProbeResult:
    ok: bool
    output: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_probe(script: str, root: Path, world_size: int = 1, timeout_s: float = 120.0) -> ProbeResult:
    """Run tests/patch_probes/<script> on `world_size` CPU processes against the nanotron in `root`.

    ok is True when every rank exits 0. When one rank fails, the others (which may be blocked in
    a collective waiting for it) are killed after a short grace period, so a failure never hangs.
    """
    root = root.resolve()
    port = _free_port()
    base_env = dict(os.environ)
    base_env.update(
        PYTHONPATH=str(root), NANOTRON_PROBE_ROOT=str(root), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1",
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
    )
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world_size)]
    procs = []
    for rank in range(world_size):
        env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PROBE_DIR / script)], env=env, cwd=PROBE_DIR,
                stdout=logs[rank], stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout_s
    first_failure = None
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            timed_out = now > deadline
            if timed_out or (first_failure is not None and now - first_failure > 5.0):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = [f"probe timed out after {timeout_s:.0f}s"] if timed_out else []
    for rank, log in enumerate(logs):
        log.seek(0)
        output.append(f"----- rank {rank} (exit {procs[rank].returncode}) -----\n{log.read()}")
        log.close()
    return ProbeResult(ok=all(p.returncode == 0 for p in procs), output="\n".join(output))


@dataclasses.dataclass(frozen=True)
class Probe:
    script: str
    world_size: int
    # What the unpatched copy must fail with: the defect itself, not an unrelated error.
    defect: str


PROBES: Dict[str, Probe] = {
    "0001": Probe("probe_0001_imports.py", 1,
                  r"ImportError: cannot import name .* \(most likely due to a circular import\)"),
    "0002": Probe("probe_0002_dist_init.py", 2, r"NotImplementedError: CUDA was not found"),
    "0003": Probe("probe_0003_parallel_context.py", 2, r"in set_device\n.*torch\.cuda\.set_device"),
    "0004": Probe(
        "probe_0004_cpu_devices.py", 2,
        r"CHECK fp32_grad_accumulator FAILED(.|\n)*device=\"cuda\"(.|\n)*CHECK synced_random_state FAILED",
    ),
    "0005": Probe("probe_0005_validate.py", 1, r"assert output\[\"loss\"\]\.requires_grad\n.*AssertionError"),
    "0006": Probe("probe_0006_row_linear.py", 2, r"mismatched \['input gradient"),
    "0007": Probe("probe_0007_comm_hooks.py", 2, r"has no attribute 'register_comm_hook'"),
    "0008": Probe("probe_0008_state_queues.py", 1,
                  r"inherits queued entries: \{'microbatches_activations_requiring_backward': 2\}"),
}
SLOW = {number for number, probe in PROBES.items() if probe.world_size > 1}
IN_SERIES = [number for number in PROBES if any(name.startswith(number + "-") for name in SERIES)]


def _param(number: str):
    return pytest.param(number, marks=[pytest.mark.slow] if number in SLOW else [], id=_patch_named(number))


def test_every_patch_has_a_probe() -> None:
    missing = [name for name in SERIES if name.split("-", 1)[0] not in PROBES]
    assert not missing, f"add a probe to tests/patch_probes/ and PROBES for {missing}"


def test_each_patch_reverses_alone_from_the_patched_tree(patched_root: Path) -> None:
    for name in SERIES:
        result = patch_cmd(patched_root, name, "-R", "--dry-run")
        assert result.returncode == 0, f"{name} does not reverse alone:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("number", [_param(n) for n in IN_SERIES])
def test_probe_passes_with_all_patches(number: str, patched_root: Path) -> None:
    probe = PROBES[number]
    result = run_probe(probe.script, patched_root, probe.world_size)
    assert result.ok, result.output


@pytest.mark.parametrize("number", [_param(n) for n in IN_SERIES])
def test_probe_fails_without_the_patch(number: str, without_patch) -> None:
    probe = PROBES[number]
    result = run_probe(probe.script, without_patch(number), probe.world_size)
    assert not result.ok, f"probe passed without patch {number}:\n{result.output}"
    assert re.search(probe.defect, result.output), f"failed, but not with the defect {probe.defect!r}:\n{result.output}"


@pytest.mark.slow
def test_parallel_context_needs_0002_too(without_patch) -> None:
    """0003 passes the backend on to 0002's initialize_torch_distributed(backend=...)."""
    result = run_probe(PROBES["0003"].script, without_patch("0002"), world_size=2)
    assert not result.ok
    assert "unexpected keyword argument 'backend'" in result.output, result.output


# --------------------------------------------------------------------------------------------
# The applier and the import-time check
# --------------------------------------------------------------------------------------------
def run_apply(target: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PATCH_DIR / "apply.py"), "--target", str(target), *args],
        capture_output=True, text=True, timeout=60,
    )


def test_pristine_copy_is_the_wheel(pristine_root: Path) -> None:
    """Reversing the series restores every file to the hash recorded in the wheel's RECORD."""
    record = record_hashes()
    tree = tree_hashes(pristine_root)
    assert {p: h for p, h in tree.items() if not p.endswith(".pyc")} == record


def test_apply_check_reports_an_unpatched_copy(pristine_root: Path, workdir: Path) -> None:
    root = workdir / "check-pristine"
    shutil.copytree(pristine_root, root)
    before = tree_hashes(root)
    result = run_apply(root, "--check")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "not applied: " + ", ".join(SERIES) in result.stdout
    assert tree_hashes(root) == before, "--check must not modify anything"


def test_apply_then_reapply_is_a_noop(pristine_root: Path, patched_root: Path, workdir: Path) -> None:
    root = workdir / "apply-pristine"
    shutil.copytree(pristine_root, root)

    first = run_apply(root)
    assert first.returncode == 0, first.stdout + first.stderr
    assert [line.split()[-1] for line in first.stdout.splitlines() if line.strip().startswith("applied")] == SERIES
    assert (root / "nanotron" / STAMP_NAME).read_text() == expected_stamp()
    # Byte for byte what `make setup` produced in .venv.
    assert tree_hashes(root) == tree_hashes(patched_root)
    assert not list(root.rglob("*.rej")) and not list(root.rglob("*.orig"))

    applied = tree_hashes(root)
    second = run_apply(root)
    assert second.returncode == 0, second.stdout + second.stderr
    assert [line.split()[-1] for line in second.stdout.splitlines() if "already applied" in line] == SERIES
    assert tree_hashes(root) == applied

    check = run_apply(root, "--check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_apply_refuses_a_tree_it_cannot_patch(pristine_root: Path, workdir: Path) -> None:
    root = workdir / "apply-foreign"
    shutil.copytree(pristine_root, root)
    engine = root / "nanotron" / "parallel" / "pipeline_parallel" / "engine.py"
    engine.write_text(engine.read_text().replace("# Add output as activations", "# (edited locally)"))
    result = run_apply(root)
    assert result.returncode != 0
    assert "does not apply" in result.stderr and "0005" in result.stderr
    assert not (root / "nanotron" / STAMP_NAME).exists()


def test_apply_without_gnu_patch_gives_the_same_tree(pristine_root: Path, patched_root: Path, workdir: Path) -> None:
    """Where GNU patch is not installed (a minimal GPU image), apply.py's own applier makes the same tree,
    recognises it as patched, and refuses a tree its hunks do not match."""
    empty_bin = workdir / "no-patch-bin"
    empty_bin.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=str(empty_bin))

    def run(root: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(PATCH_DIR / "apply.py"), "--target", str(root)],
                              capture_output=True, text=True, timeout=60, env=env)

    root = workdir / "apply-python"
    shutil.copytree(pristine_root, root)
    first = run(root)
    assert first.returncode == 0, first.stdout + first.stderr
    assert tree_hashes(root) == tree_hashes(patched_root)
    second = run(root)
    assert [line.split()[-1] for line in second.stdout.splitlines() if "already applied" in line] == SERIES
    foreign = workdir / "apply-python-foreign"
    shutil.copytree(pristine_root, foreign)
    engine = foreign / "nanotron" / "parallel" / "pipeline_parallel" / "engine.py"
    engine.write_text(engine.read_text().replace("# Add output as activations", "# (edited locally)"))
    refused = run(foreign)
    assert refused.returncode != 0 and "0005" in refused.stderr


def _import_nanotron_ext(root: Path) -> subprocess.CompletedProcess:
    # cwd=REPO puts this checkout's nanotron_ext first; PYTHONPATH picks the nanotron copy.
    env = dict(os.environ, PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", "import nanotron_ext"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_check_rejects_a_missing_stamp(patched_root: Path, workdir: Path) -> None:
    root = workdir / "no-stamp"
    shutil.copytree(patched_root, root)
    (root / "nanotron" / STAMP_NAME).unlink()
    result = _import_nanotron_ext(root)
    assert result.returncode != 0
    assert "ImportError: nanotron patches not applied" in result.stderr, result.stderr
    assert str(root / "nanotron") in result.stderr, "the error must name the copy that lacks the stamp"


def test_import_check_rejects_a_stale_stamp(patched_root: Path, workdir: Path) -> None:
    root = workdir / "stale-stamp"
    shutil.copytree(patched_root, root)
    stamp = root / "nanotron" / STAMP_NAME
    stamp.write_text(stamp.read_text().splitlines(keepends=True)[0])  # as if written by a shorter series
    result = _import_nanotron_ext(root)
    assert result.returncode != 0
    assert "carries an older patch series" in result.stderr, result.stderr


def test_import_check_accepts_the_patched_copy(patched_root: Path) -> None:
    result = _import_nanotron_ext(patched_root)
    assert result.returncode == 0, result.stderr
