"""Issue 53 item 7: the shell and make entry points fuzzed as tests/test_flag_fuzz.py fuzzes the Python flags. Every
option and environment variable of scripts/*.sh and every Makefile variable a user sets, given a hostile value
(command substitution, backquotes, `;`, a newline, arithmetic evaluation, make's $(shell), huge, negative, empty):
exit code != 0, one line on stderr naming the variable or flag, and nothing run (every tool that does work is a
stub that logs its call), nothing created or deleted in the sandbox, no mark file. Then the other side: good values
reach the command as one argument each, and `make gpu-check`'s install folder is private (issue 53 item 2)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.helpers.fuzz_values import COUNT_HOSTILE, Values, shell_hostile

REPO = Path(__file__).resolve().parents[1]
REAL_TOOLS = ("dirname", "date", "sed", "awk", "df", "mktemp", "rm", "mkdir", "cat", "head", "tail", "ls", "find",
              "grep", "tr", "sort", "stat", "touch", "make", "sh", "bash", "env", "basename", "rmdir", "chmod")
STUBS = ("buildah", "debootstrap", "docker", "ip", "tc", "sysctl", "npm", "apt-get", "dpkg-deb", "tar", "apt-config",
         "python3", "pip", "torchrun", "ruff", "chroot")


class Box:
    """A sandbox: a PATH of the basic tools and logging stubs, a user's file that must survive, a mark file."""

    def __init__(self, root: Path) -> None:
        self.root, self.bin, self.log, self.mark = root, root / "bin", root / "calls.log", root / "MARK"
        self.bin.mkdir(parents=True)
        for name in REAL_TOOLS:
            if shutil.which(name):
                (self.bin / name).symlink_to(shutil.which(name))
        for name in STUBS:
            self.stub(name, f'echo {name} "$@" >> {self.log}; exit 1')
        self.stub("id", "echo 0")  # past every root check: a value the checks miss reaches the stubs
        (root / "keep").mkdir()
        (root / "keep" / "corpus.txt").write_text("mine\n")
        (root / "wheels").mkdir()  # make gpu-check's WHEELS: none (nanotron_ext imports as installed)
        venv = root / "venv"  # the Makefile's VENV: stubs, and a stamp newer than pyproject.toml (setup is done)
        (venv / "bin").mkdir(parents=True)
        for name in ("python", "pip", "torchrun", "ruff"):
            (venv / "bin" / name).symlink_to(self.bin / ("python3" if name == "python" else name))
        (venv / ".installed").touch()
        self.before = self.listing()

    def stub(self, name: str, body: str) -> None:
        (self.bin / name).unlink(missing_ok=True)
        (self.bin / name).write_text(f"#!/bin/sh\n{body}\n")
        (self.bin / name).chmod(0o755)

    def listing(self) -> List[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p != self.log)

    def env(self, **extra: str) -> Dict[str, str]:
        return {"PATH": str(self.bin), "HOME": str(self.root), "LANG": "C.UTF-8", "TMPDIR": str(self.root), **extra}

    def refusal_problem(self, out: subprocess.CompletedProcess, name: str) -> str | None:
        lines = out.stderr.splitlines()
        if out.returncode == 0:
            return "exit code 0"
        if len(lines) != 1 or name not in lines[0]:
            return f"not one line naming {name}: {out.stderr!r}"
        if self.mark.exists():
            return "ran the value (the mark file exists)"
        if self.log.exists():
            return f"ran tools: {self.log.read_text()!r}"
        if self.listing() != self.before:
            return f"changed the sandbox: {sorted(set(self.listing()) ^ set(self.before))}"
        return None


def _hostile(box: Box, *more: Tuple[str, str]) -> Values:
    return shell_hostile(box.mark) + list(more)


# (entry point, variable or flag, extra values beyond the hostile ones); how each is given is in _run
CASES: List[Tuple[str, str, Values]] = [
    ("build_image.sh", "MIN_FREE_GB", COUNT_HOSTILE),
    ("build_image.sh", "BUILD_DIR", [("empty", ""), ("relative", "rel/build"), ("the root", "/")]),
    ("build_image.sh", "IMAGE_TAG", [("empty", "")]),
    ("build_image.sh", "DEBIAN_SUITE", [("empty", "")]),
    ("build_image.sh", "TORCH_SPEC", [("empty", "")]),
    ("build_image.sh", "DEBIAN_MIRROR", [("no scheme", "mirror.local/debian")]),
    ("build_image.sh", "TORCH_INDEX_URL", [("no scheme", "index.local/cpu")]),
    ("build_image.sh", "--engine", [("empty", ""), ("unknown", "podman")]),
    ("build_image.sh", "--result", [("empty", "")]),
    ("netns_pipeline.sh", "--rate", [("empty", ""), ("negative", "-1mbit"), ("no unit", "80")]),
    ("netns_pipeline.sh", "--burst", [("empty", ""), ("negative", "-64kb")]),
    ("netns_pipeline.sh", "--mtu", COUNT_HOSTILE + [("above 65535", "65536"), ("below 68", "67")]),
    ("netns_pipeline.sh", "--port", COUNT_HOSTILE + [("zero", "0"), ("above 65535", "65536")]),
    ("prepare_gpu_mix.sh", "CONFIG.yaml", [("missing", "missing.yaml")]),
    ("prepare_gpu_mix.sh", "MIX_DIR", [("empty", "")]),
    ("prepare_gpu_mix.sh", "PYTHON", [("empty", ""), ("missing", "no-such-python")]),
    ("make gpu-check", "STAGES", [("an unknown stage", "bogus")]),
    ("make gpu-check", "GPU_SITE", [("relative", "rel/site"), ("with a ':'", "/tmp/a:b")]),
    ("make gpu-check", "WHEELS", [("empty", "")]),
    ("make train-tiny", "NPROC", COUNT_HOSTILE + [("zero", "0")]),
    ("make train-tiny", "CONFIG", [("empty", ""), ("missing", "missing.yaml")]),
    ("make test-quick", "TEST_WORKERS", COUNT_HOSTILE),
    ("make setup", "EXTRAS", [("an unknown character", "eval flash")]),
    ("make setup", "TORCH_CPU", [("empty", "")]),
]


# Makefile variables not fuzzed, and why (DRY_RUN, not set with ?=, is only compared with $(filter 1 yes true,...))
NOT_FUZZED = {
    "PYTHON": "a command by nature (the interpreter make gpu-check and setup run); quoted by nothing on purpose",
    "GPU_CHECK_ARGS": "benchmarks/gpu_check.py's own flags, one quoted word each (its parser checks them: "
                      "tests/test_flag_fuzz.py)",
}


def test_every_script_and_make_variable_is_fuzzed() -> None:
    scripts = {p.name for p in (REPO / "scripts").glob("*.sh")}
    assert scripts == {e for e, _, _ in CASES if not e.startswith("make ")}, scripts
    variables = {line.split("?=")[0].strip() for line in (REPO / "Makefile").read_text().splitlines()
                 if "?=" in line and not line.startswith(("#", "\t"))}
    fuzzed = {n for e, n, _ in CASES if e.startswith("make ")} | {"VENV"}  # VENV: test_make_venv_is_checked
    assert variables == fuzzed | set(NOT_FUZZED), sorted(variables ^ (fuzzed | set(NOT_FUZZED)))


def test_the_makefile_knows_gpu_checks_stages() -> None:
    """Every stage gpu_check runs: the default ones (gpu_check_plan) and those run only when named (the GEMM table)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check_gemm import STAGE as GEMM
    from gpu_check_plan import STAGES

    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if x.startswith("GPU_CHECK_STAGES :="))
    assert tuple(line.split(":=")[1].split()) == (*STAGES, GEMM)


def test_make_venv_is_checked(tmp_path: Path) -> None:
    box = Box(tmp_path)
    for what, value in shell_hostile(box.mark) + [("empty", ""), ("a space", "my venv")]:
        out = subprocess.run(["make", "-s", "-C", str(REPO), "lint", f"VENV={value}"], capture_output=True,
                             text=True, env=box.env(), timeout=60)
        assert box.refusal_problem(out, "VENV") is None, (what, box.refusal_problem(out, "VENV"))


def _run(box: Box, entry: str, name: str, value: str) -> subprocess.CompletedProcess:
    env = box.env()
    if entry.startswith("make "):
        argv = ["make", "-s", "-C", str(REPO), entry.split()[1], f"VENV={box.root / 'venv'}",
                f"PYTHON={box.bin / 'python3'}", f"{name}={value}"]
    elif entry == "build_image.sh":
        argv = ["bash", str(REPO / "scripts" / entry), "--stand-in"]
        if name.startswith("--"):
            argv += [name, value]
        else:
            env.update({"MIN_FREE_GB": "0", "BUILD_DIR": str(box.root / "build"), name: value})
    elif entry == "netns_pipeline.sh":
        argv = ["bash", str(REPO / "scripts" / entry), name, value, "--", "true"]
    else:  # prepare_gpu_mix.sh works in the folder above its own: a copy in the sandbox
        script = box.root / "scripts" / entry
        if not script.exists():
            script.parent.mkdir()
            shutil.copy(REPO / "scripts" / entry, script)
            box.before = box.listing()
        config = value if name == "CONFIG.yaml" else str(REPO / "examples" / "config_tiny_llama.yaml")
        env.update({name: value} if name != "CONFIG.yaml" else {})
        argv = ["bash", str(script), config]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=box.root, timeout=60)


@pytest.mark.parametrize("entry, name, extra", CASES, ids=[f"{e} {n}" for e, n, _ in CASES])
def test_hostile_values_are_refused_in_one_line_and_run_nothing(entry: str, name: str, extra: Values,
                                                                 tmp_path: Path) -> None:
    problems = []
    for i, (what, value) in enumerate(_hostile(Box(tmp_path / "probe"), *extra)):
        box = Box(tmp_path / f"case{i}")
        value = value.replace(str(tmp_path / "probe" / "MARK"), str(box.mark))
        problem = box.refusal_problem(_run(box, entry, name, value), name)
        if problem:
            problems.append(f"{what} ({value!r}): {problem}")
    assert not problems, f"{entry} {name}:\n" + "\n".join(problems)


# -- the other side: good values reach the command as they are, one argument each -----------------------------------
LOGGING_PYTHON = """#!{python}
import json, os, subprocess, sys
argv = sys.argv[1:]
site = argv[argv.index("--site") + 1] if "--site" in argv else None
info = os.stat(site) if site and os.path.isdir(site) else None
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": argv, "pythonpath": os.environ.get("PYTHONPATH", ""),
                         "site_mode": info and oct(info.st_mode & 0o777), "site_uid": info and info.st_uid}}) + "\\n")
# the wheel installer for real; in place of the GPU check a bare start-up (a planted sitecustomize.py would run)
sys.exit(subprocess.call([{python!r}, *argv] if argv[0] == "scripts/gpu_wheels.py" else [{python!r}, "-c", ""]))
"""


def _logging_python(box: Box) -> List[dict]:
    log = box.root / "python.log"
    (box.bin / "python3").unlink()
    (box.bin / "python3").write_text(LOGGING_PYTHON.format(python=sys.executable, log=str(log)))
    (box.bin / "python3").chmod(0o755)
    return []


def _calls(box: Box) -> List[dict]:
    log = box.root / "python.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _gpu_check(box: Box, *variables: str) -> subprocess.CompletedProcess:
    argv = ["make", "-s", "-C", str(REPO), "gpu-check", f"PYTHON={box.bin / 'python3'}",
            f"WHEELS={box.root / 'wheels'}", *variables]
    return subprocess.run(argv, capture_output=True, text=True, env=box.env(), timeout=120)


def test_make_gpu_check_passes_stages_and_args_as_one_word_each_into_a_fresh_private_site(tmp_path: Path) -> None:
    box = Box(tmp_path)
    _logging_python(box)
    out = _gpu_check(box, "STAGES=throughput,profile", "GPU_CHECK_ARGS=--copy-to /x/y z")
    assert out.returncode == 0, out.stderr
    install, check = _calls(box)
    site = install["argv"][install["argv"].index("--site") + 1]
    assert install["site_mode"] == "0o700" and install["site_uid"] == os.getuid(), install
    assert Path(site).parent == tmp_path and not Path(site).exists()  # fresh under TMPDIR, removed at the end
    assert check["argv"] == ["benchmarks/gpu_check.py", "--stages", "throughput,profile", "--copy-to", "/x/y", "z"]
    assert check["pythonpath"].split(":")[:2] == [str(REPO), site]


@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_make_gpu_check_refuses_a_site_another_user_could_plant_code_in(how: str, tmp_path: Path) -> None:
    """The probe: a sitecustomize.py another local user planted in the default /tmp/site ran as root."""
    box = Box(tmp_path)
    _logging_python(box)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(box.mark)!r}, 'w').close()\n")
    if how == "writable by others":
        site.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(site, 65534, 65534)
    else:
        pytest.skip("giving a folder to another user needs root (CI runs as root)")
    box.before = box.listing()
    out = _gpu_check(box, f"GPU_SITE={site}")
    assert box.refusal_problem(out, "GPU_SITE") is None, box.refusal_problem(out, "GPU_SITE")
    assert _calls(box) == []
    # the installer refuses it too, called directly (one line naming --site, exit 2)
    direct = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_wheels.py"), "install", "--dest",
                             str(box.root / "wheels"), "--site", str(site)], capture_output=True, text=True)
    assert direct.returncode == 2 and len(direct.stderr.splitlines()) == 1 and "--site" in direct.stderr, direct.stderr
    assert not box.mark.exists() and stat.S_IMODE(site.stat().st_mode) in (0o777, 0o755)


def test_make_train_tiny_passes_nproc_and_config_as_they_are(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.stub("torchrun", f'printf "%s\\n" "$@" > {box.root / "torchrun.args"}')
    (box.root / "venv" / "bin" / "python").unlink()
    (box.root / "venv" / "bin" / "python").symlink_to(box.bin / "true" if (box.bin / "true").exists() else "/bin/true")
    config = tmp_path / "my config.yaml"
    shutil.copy(REPO / "examples" / "config_tiny_llama.yaml", config)
    out = subprocess.run(["make", "-s", "-C", str(REPO), "train-tiny", f"VENV={box.root / 'venv'}", "NPROC=3",
                          f"CONFIG={config}"], capture_output=True, text=True, env=box.env(), timeout=60)
    assert out.returncode == 0, out.stderr
    args = (box.root / "torchrun.args").read_text().splitlines()
    assert "--nproc_per_node=3" in args and args[-2:] == ["--config-file", str(config)]


# -- the files a script reads, damaged (tests/test_read_file_fuzz.py's rule for the shell entry points) ---------------
def test_damaged_apt_sources_are_one_line_naming_debian_mirror(tmp_path: Path) -> None:
    """build_image.sh --stand-in reads the Debian mirror from apt's sources: garbage, binary, empty or a deb822
    stanza without URIs gives no mirror, refused in one line naming DEBIAN_MIRROR; nothing in them runs."""
    from tests.helpers.file_fuzz import BINARY

    for i, content in enumerate([b"deb $(touch MARK) bookworm main\n", BINARY, b"",
                                 b"Types: deb\nSuites: bookworm\n", b"deb [unclosed http://x.local/debian bookworm\n"]):
        box = Box(tmp_path / f"case{i}")
        etc = box.root / "keep" / "apt"
        (etc / "sources.list.d").mkdir(parents=True)
        (etc / "sources.list").write_bytes(content.replace(b"MARK", str(box.mark).encode()))
        (etc / "sources.list.d" / "debian.sources").write_bytes(content)
        box.stub("apt-config", f"echo \"LIST='{etc}/sources.list'\"; echo \"PARTS='{etc}/sources.list.d/'\"")
        box.before = box.listing()
        out = subprocess.run(["bash", str(REPO / "scripts" / "build_image.sh"), "--stand-in"], capture_output=True,
                             text=True, env=box.env(MIN_FREE_GB="0", BUILD_DIR=str(box.root / "keep" / "build")),
                             cwd=box.root, timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (content, out.stderr)
        assert "DEBIAN_MIRROR" in out.stderr and str(etc / "sources.list") in out.stderr, out.stderr
        assert not box.mark.exists() and "debootstrap" not in box.log.read_text(), (content, box.log.read_text())


def test_a_result_file_the_script_did_not_write_is_never_replaced(tmp_path: Path) -> None:
    """build_image.sh --result replaces only its own JSON (its written_by): a user's JSON, a binary file, a folder, a
    FIFO (never opened: it would block), a symbolic link to its own result, and a new result whose log
    (<result>-test-quick.log) exists already are refused before any work."""
    box = Box(tmp_path)
    ours = box.root / "keep" / "ours.json"
    ours.write_text('{"written_by": "scripts/build_image.sh", "engine": "buildah"}\n')
    (box.root / "keep" / "user.json").write_text('{"rows": []}\n')
    (box.root / "keep" / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (box.root / "keep" / "folder").mkdir()
    os.mkfifo(box.root / "keep" / "fifo.json")
    (box.root / "keep" / "link.json").symlink_to(ours)
    (box.root / "keep" / "new-test-quick.log").write_text("a user's log\n")  # the log a new.json would name
    box.before = box.listing()
    for name in ("user.json", "binary.json", "folder", "fifo.json", "link.json", "new.json"):
        out = subprocess.run(["bash", str(REPO / "scripts" / "build_image.sh"), "--stand-in", "--result",
                              str(box.root / "keep" / name)], capture_output=True, text=True,
                             env=box.env(MIN_FREE_GB="0", BUILD_DIR=str(box.root / "build")), timeout=60)
        assert box.refusal_problem(out, "--result") is None, (name, box.refusal_problem(out, "--result"))


@pytest.mark.parametrize("script, flag", [("build_image.sh", "--engine"), ("build_image.sh", "--result"),
                                          ("netns_pipeline.sh", "--rate"), ("netns_pipeline.sh", "--burst"),
                                          ("netns_pipeline.sh", "--mtu"), ("netns_pipeline.sh", "--port")])
def test_a_flag_without_its_value_is_one_line_naming_it(script: str, flag: str, tmp_path: Path) -> None:
    """The probe: bash's own `${2:?}` message (its line number, exit 1) where a value was missing."""
    box = Box(tmp_path)
    out = subprocess.run(["bash", str(REPO / "scripts" / script), flag], capture_output=True, text=True,
                         env=box.env(), cwd=box.root, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and flag in out.stderr, out.stderr
    assert ": line " not in out.stderr and not box.log.exists(), out.stderr


def test_gpu_wheels_fill_replaces_only_the_wheels_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`make gpu-wheels` (fill) deleted every wheel of a carried distribution in --dest: now only those its manifest
    lists; a user's own nanotron wheel is refused in one line before any download, and kept."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_wheels

    dest = tmp_path / "whl"
    dest.mkdir()
    mine = dest / "nanotron-0.4-py3-none-any.whl"
    mine.write_bytes(b"a user's own build")
    (dest / "unrelated-1.0-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(SystemExit) as stop:
        gpu_wheels.main(["fill", "--dest", str(dest)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and f"--dest {dest}" in err and mine.name in err, err
    assert mine.read_bytes() == b"a user's own build"
    (dest / gpu_wheels.MANIFEST).write_text(f"{mine.name}\n")  # written by an earlier fill: replaceable
    assert gpu_wheels.replaceable(dest) == [mine]


def test_make_clean_venv_deletes_only_a_venv_make_setup_made(tmp_path: Path) -> None:
    box = Box(tmp_path)
    out = subprocess.run(["make", "-s", "-C", str(REPO), "clean-venv", f"VENV={box.root / 'keep'}"],
                         capture_output=True, text=True, env=box.env(), timeout=60)
    assert box.refusal_problem(out, "VENV") is None, box.refusal_problem(out, "VENV")
    made = subprocess.run(["make", "-s", "-C", str(REPO), "clean-venv", f"VENV={box.root / 'venv'}"],
                          capture_output=True, text=True, env=box.env(), timeout=60)
    assert made.returncode == 0 and not (box.root / "venv").exists(), made.stderr  # its .installed stamp: make's
