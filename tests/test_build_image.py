"""The Docker image's build (scripts/build_image.sh, Dockerfile; docs/profiling-and-benchmarks.md "The Docker image"):
which base images' torch the install step accepts (pip itself, against an installed pre-release), the Nsight step on
a base without NVIDIA's repository, the script's one-line refusals; and, opt-in (NANOTRON_EXT_IMAGE_BUILD=1), the
stand-in image built for real with one training step inside it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "build_image.sh"

# torch as NVIDIA's PyTorch images ship it (docs/profiling-and-benchmarks.md, "Supported base images")
ACCEPTED = {"25.11": "2.10.0a0+b558c986e8.nv25.11", "25.12": "2.10.0a0+b4e4ee81d3",
            "26.01": "2.10.0a0+a36e1d39eb.nv26.01.42222806", "stand-in": "2.13.0+cpu"}
REFUSED = {"25.08": "2.8.0a0+34c6371d24", "25.09": "2.9.0a0+50eac811a6.nv25.09",
           "25.10": "2.9.0a0+145a3a7bda.nv25.10"}


def _torch_requirement() -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return torch


@pytest.mark.parametrize("image, version", [*ACCEPTED.items(), *REFUSED.items()])
def test_the_torch_bound_accepts_the_supported_images_pre_releases(image: str, version: str) -> None:
    """PEP 440: 2.9.0a0 sorts below 2.9 (refused whatever the pre-release flag), 2.10.0a0 above it; an installed
    pre-release counts (pip's rule for installed distributions: prereleases=True)."""
    assert _torch_requirement().specifier.contains(version, prereleases=True) == (image in ACCEPTED), image


def _wheel(folder: Path, requirement: str) -> None:
    """A minimal wheel `needs_torch` whose one dependency is `requirement`."""
    info = "needs_torch-0.1.dist-info"
    with zipfile.ZipFile(folder / "needs_torch-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: needs_torch\nVersion: 0.1\n"
                                         f"Requires-Dist: {requirement}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.mark.parametrize("image", ["25.10", "25.11", "25.12"])
def test_pip_with_the_image_pin_accepts_the_installed_pre_release(tmp_path: Path, image: str) -> None:
    """The Dockerfile's step, by pip itself: an environment whose torch is NVIDIA's pre-release, the image's torch as
    a constraint (-c), a package requiring pyproject's torch bound; pip must install nothing but the package
    (25.11 on) or refuse (25.10), never look for another torch."""
    version = {**ACCEPTED, **REFUSED}[image]
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    (site,) = env_dir.glob("lib/python*/site-packages")
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, str(_torch_requirement()))
    (tmp_path / "image-torch.txt").write_text(f"torch=={version}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip configuration (local wheels, a torch cap) stays out
    pin = tmp_path / "image-torch.txt"
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                          "--dry-run", "--no-index", "--find-links", str(wheels), "-c", str(pin), "needs_torch"],
                         capture_output=True, text=True, env=env)
    if image in ACCEPTED:
        assert out.returncode == 0 and "Would install needs_torch-0.1" in out.stdout, out.stdout + out.stderr
        assert out.stdout.split("Would install")[1].split() == ["needs_torch-0.1"], out.stdout  # no other torch
    else:
        assert out.returncode != 0 and "ResolutionImpossible" in out.stderr, out.stdout + out.stderr


def _fake_bin(tmp_path: Path, tools: dict[str, str]) -> dict[str, str]:
    """A PATH of only `tools` (name -> script body, or '' for the machine's own command)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in tools.items():
        if body:
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        else:
            (bin_dir / name).symlink_to(shutil.which(name))
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "LANG": "C.UTF-8"}


def test_the_nsight_step_says_so_in_one_line_without_nvidias_repository(tmp_path: Path) -> None:
    """The Dockerfile's Nsight step on a base with no nsys and no apt source offering nsight-systems-cli (the
    stand-in): one line, exit 0, nothing installed."""
    steps = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    (nsight,) = [line[len("RUN "):] for line in steps.splitlines() if line.startswith("RUN ") and "nsys" in line]
    log = tmp_path / "calls"
    env = _fake_bin(tmp_path, {"apt-get": f"echo apt-get \"$@\" >> {log}",
                               "apt-cache": f"echo apt-cache \"$@\" >> {log}; exit 100",
                               "rm": f"echo rm \"$@\" >> {log}"})
    out = subprocess.run([shutil.which("bash"), "-c", nsight], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "nsys: not in the base image and no apt repository offers nsight-systems-cli; no nsys in this image"]
    assert "install" not in log.read_text()


def _script(tmp_path: Path, tools: dict[str, str], *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    base = {name: "" for name in ("dirname", "date", "sed", "id", "df", "awk", "mktemp", "rm", "mkdir", "cat",
                                                  "head", "tail", "ls", "find")}
    env = _fake_bin(tmp_path, {**base, **tools})
    env.update({"BUILD_DIR": str(tmp_path / "build"), **env_vars})
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_the_build_script_names_a_missing_tool_and_how_to_get_it(tmp_path: Path) -> None:
    out = _script(tmp_path, {}, "--engine", "buildah")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == ["build_image.sh: error: buildah not found; install it: apt-get install -y "
                                       "buildah (Debian/Ubuntu), dnf install buildah (Fedora)"]


def test_the_stand_in_needs_debootstrap_and_root(tmp_path: Path) -> None:
    out = _script(tmp_path, {"buildah": "exit 0"}, "--stand-in")
    line = ("build_image.sh: error: a daemonless build with --isolation chroot needs root (run it with sudo)"
            if os.geteuid() != 0 else "build_image.sh: error: debootstrap not found; install it: apt-get install -y "
                                      "debootstrap")
    assert out.returncode == 1 and out.stderr.splitlines() == [line]


def test_the_build_script_refuses_too_little_space(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the space check comes after the root check")
    out = _script(tmp_path, {"buildah": "exit 0", "debootstrap": "exit 0"}, "--stand-in", MIN_FREE_GB="1000000")
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert re.fullmatch(rf"build_image.sh: error: \d+ GB free at {re.escape(str(tmp_path / 'build'))}, at least "
                        r"1000000 GB needed \(the vfs driver stores each layer whole\); set BUILD_DIR to a roomier "
                        r"disk\n", out.stderr), out.stderr


def test_the_build_script_refuses_an_unknown_option_in_one_line(tmp_path: Path) -> None:
    out = _script(tmp_path, {}, "--stand_in")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["build_image.sh: unknown option --stand_in (--help lists them)"]
    (tmp_path / "again").mkdir()
    usage = _script(tmp_path / "again", {}, "--help")
    assert usage.returncode == 0 and "--stand-in" in usage.stdout and "--smoke" in usage.stdout



# -- issue 53: --remove deletes only a folder it made; the stand-in's mirror comes from this machine's apt sources --
AS_ROOT = {"id": "echo 0", "buildah": "exit 1", "debootstrap": "exit 0"}  # past the root check, no image to reuse


def test_remove_leaves_a_folder_it_did_not_make(tmp_path: Path) -> None:
    """The script itself advises BUILD_DIR on a roomier disk: a user's folder named that way survives --remove,
    which refuses in one line (exit 2); so does a build into it."""
    roomy = tmp_path / "roomy"
    (roomy / "my_datasets").mkdir(parents=True)
    (roomy / "my_datasets" / "corpus.txt").write_text("mine\n")
    for i, args in enumerate([("--remove",), ("--stand-in",)]):
        (tmp_path / f"run{i}").mkdir()
        out = _script(tmp_path / f"run{i}", AS_ROOT, *args, BUILD_DIR=str(roomy), MIN_FREE_GB="0")
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, (args, out.stderr)
        assert out.stderr.startswith(f"build_image.sh: error: BUILD_DIR={roomy}: ") and "did not make" in out.stderr
        assert sorted(p.name for p in roomy.rglob("*")) == ["corpus.txt", "my_datasets"], args
    assert (roomy / "my_datasets" / "corpus.txt").read_text() == "mine\n"


def test_remove_deletes_the_folder_it_made(tmp_path: Path) -> None:
    """A build makes BUILD_DIR and marks it (here it stops at the space check); --remove then deletes it."""
    build = tmp_path / "deep" / "build"
    (tmp_path / "a").mkdir()
    made = _script(tmp_path / "a", AS_ROOT, "--stand-in", BUILD_DIR=str(build), MIN_FREE_GB="999999")
    assert made.returncode == 1 and "at least 999999 GB needed" in made.stderr, made.stderr
    assert build.is_dir()
    (tmp_path / "b").mkdir()
    out = _script(tmp_path / "b", AS_ROOT, "--remove", BUILD_DIR=str(build))
    assert out.returncode == 0 and out.stderr == "" and not build.exists(), out.stderr
    assert (tmp_path / "deep").is_dir()  # the folder above it was there before: left alone


def _apt_sources(tmp_path: Path, one_line: str, deb822: str) -> dict[str, str]:
    """A fake apt-config naming sources.list and sources.list.d under tmp_path, as apt-config shell prints them."""
    etc = tmp_path / "etc_apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(one_line)
    (etc / "sources.list.d" / "debian.sources").write_text(deb822)
    return {"apt-config": f"echo \"LIST='{etc}/sources.list'\"; echo \"PARTS='{etc}/sources.list.d/'\""}


def _stand_in_mirror(tmp_path: Path, tools: dict[str, str], **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run --stand-in up to debootstrap (a fake that records its arguments and fails): the mirror it was given."""
    calls = tmp_path / "debootstrap.args"
    out = _script(tmp_path, {**AS_ROOT, **tools, "debootstrap": f"echo \"$@\" > {calls}; exit 1"}, "--stand-in",
                  MIN_FREE_GB="0", **env)
    return out, calls.read_text().split()[-1] if calls.exists() else ""


SOURCES = ("Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
           "URIs: http://mirror.local:3142/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
           "Types: deb\nURIs: http://mirror.local:3142/debian-security\nSuites: bookworm-security\n")


def test_the_stand_in_reads_its_debian_mirror_from_apt_sources(tmp_path: Path) -> None:
    """No host of its own: the apt source that serves the suite (a local mirror or proxy); DEBIAN_MIRROR wins."""
    apt = _apt_sources(tmp_path, "deb [arch=amd64] http://other.local/ubuntu jammy main\n", SOURCES)
    out, mirror = _stand_in_mirror(tmp_path, apt)
    assert out.returncode == 1 and mirror == "http://mirror.local:3142/debian", out.stderr
    assert out.stderr.splitlines()[-1] == ("build_image.sh: error: debootstrap failed (log above; is "
                                           "http://mirror.local:3142/debian reachable?)")
    assert [p.name for p in (tmp_path / "build").iterdir()] == [".nanotron_ext-build-dir"]  # its temp folder: gone
    (tmp_path / "own").mkdir()
    out, mirror = _stand_in_mirror(tmp_path / "own", apt, DEBIAN_MIRROR="http://given.local/debian")
    assert mirror == "http://given.local/debian", out.stderr
    (tmp_path / "one_line").mkdir()
    one_line = _apt_sources(tmp_path / "one_line", "# deb http://old.local/debian bookworm main\n"
                                                   "deb [ signed-by=/k.gpg ] http://list.local/debian bookworm main\n",
                            SOURCES)
    assert _stand_in_mirror(tmp_path / "one_line", one_line)[1] == "http://list.local/debian"


def test_no_apt_source_for_the_suite_is_one_line_naming_debian_mirror(tmp_path: Path) -> None:
    apt = _apt_sources(tmp_path, "deb http://other.local/ubuntu jammy main\n", "Types: deb\nURIs: http://x/d\n"
                       "Suites: trixie\n\nEnabled: no\nTypes: deb\nURIs: http://off.local/debian\nSuites: bookworm\n")
    out, mirror = _stand_in_mirror(tmp_path, apt)
    assert out.returncode == 2 and mirror == "", out.stderr
    assert out.stderr.splitlines() == [
        "build_image.sh: error: DEBIAN_MIRROR: no apt source of this machine serves bookworm (read "
        f"{tmp_path}/etc_apt/sources.list and {tmp_path}/etc_apt/sources.list.d/); set DEBIAN_MIRROR to a Debian "
        "mirror's URL"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("NANOTRON_EXT_IMAGE_BUILD") != "1",
                    reason="builds the stand-in image (about 15 min, root, buildah, debootstrap, network): "
                           "NANOTRON_EXT_IMAGE_BUILD=1 runs it; CI does not (docs/profiling-and-benchmarks.md)")
def test_the_stand_in_image_builds_and_trains_one_step_inside() -> None:
    out = subprocess.run(["bash", str(SCRIPT), "--stand-in", "--smoke"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "one training step inside the image" in out.stdout
    assert re.search(r"train loss", out.stdout), out.stdout[-4000:]
