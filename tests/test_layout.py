"""The package layout's rules, read from the source with `ast` (nothing is imported; the walker is
tests/helpers/imports.py):

- no import loop between nanotron_ext files at any import level (imports inside functions count, annotation-only
  ones under `if TYPE_CHECKING:` do not), but config/'s deliberate compose <-> schema;
- no import cycle between nanotron_ext packages at any import level (a package is nanotron_ext's first
  sub-package, e.g. nanotron_ext.config; a top-level module such as nanotron_ext.registry is its own);
- the core never imports a technique package, not even lazily inside a function: techniques plug
  in through nanotron_ext.registry and the `nanotron_ext.techniques` entry points;
- a technique imports another only where one paper builds on another, and declares it (`Technique.requires`);
- parallel/ does not import config/ (primitives take plain values, the config layer reads YAML);
- every technique package is declared as an entry point (its one Technique object), has the one shape
  (ARCHITECTURE.md: __init__.py with the paper map, config.py, technique.py, pieces.py) and maps its paper;
- no technique's config dataclass lives under nanotron_ext/config/ (techniques own their sections);
- core code names no technique's config key (a string literal starting with a technique's section path, e.g.
  "sparseloco." or "model.codec.resbm"), but in the paper catalogues (PAPER_CATALOGUES): what the core must know
  about a technique's keys, the technique declares (Technique.resume_keys, widths, uncompressed).

Which packages are techniques is read from pyproject.toml's entry points (what the registry loads), never listed
here: a sixth package declared there is checked by every rule (test_a_sixth_technique_is_checked_...).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Set

from tests.helpers.imports import (
    ENTRY_POINT_GROUP,
    all_imports,
    area,
    core_area,
    cycles,
    describe_cycle,
    entry_points,
    file_loops,
    modules,
    package_graph,
    resolve,
    technique_folders,
    techniques,
)

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nanotron_ext"
# where one paper builds on another (heterogeneous SparseLoCo on Subspace Models; MAPL shares only the core's
# codecs/energy.py with it)
ALLOWED_TECHNIQUE_IMPORTS = {("sparseloco", "subspace")}
# config/'s loader is the one deliberate file loop: compose.py builds Config's sections from the registered techniques
# and reads schema.Config back inside a function, once schema.py (which mounts compose's sections) is loaded
ALLOWED_FILE_EDGES = {("nanotron_ext.config.compose", "nanotron_ext.config.schema")}
# the one shape of a technique package (ARCHITECTURE.md, "A technique's object"); tests/toy_technique/ has it too
TECHNIQUE_FILES = ("__init__.py", "config.py", "technique.py", "pieces.py")
# The core files that may name a technique's config keys: catalogues of papers' systems and testbeds, whose rows are
# written as the keys each paper sets (reproduce/, the papers' own folders, is outside nanotron_ext/ and free too).
PAPER_CATALOGUES = {
    "nanotron_ext/bench/wan/systems.py",  # the WAN meter's systems: one row per paper's method, with its keys
    "nanotron_ext/bench/wan/presets.py",  # the meter's anchors: a paper's testbed and the base model it times
    "nanotron_ext/bench/workload.py",  # the BOOST reproductions' shape flags (--rank is BOOST's r; reproduce/boost/)
}
TOY = ROOT / "tests" / "toy_technique" / "toy_technique"


# -- the rules, each a list of what breaks it (empty: kept), for this tree or a copy -----------------------------
def core_imports_of_techniques(root: Path) -> List[str]:
    names, bad = techniques(root), []
    for module, path in modules(root).items():
        src = area(module)
        for name in all_imports(path, root)[1]:
            dst = area(name)
            if dst not in names or dst == src:
                continue
            if src not in names:
                bad.append(f"core module {module} imports technique {name}")
            elif (src, dst) not in ALLOWED_TECHNIQUE_IMPORTS:
                bad.append(f"technique {module} imports technique {name}")
    return bad


def declared_requires(root: Path, technique: str) -> Set[str]:
    """The names in `requires = (...)` of the Technique class in nanotron_ext/<technique>/technique.py."""
    path = root / "nanotron_ext" / technique / "technique.py"
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())) if path.exists() else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "requires" for t in node.targets):
            out.update(ast.literal_eval(node.value))
    return out


def undeclared_requires(root: Path) -> List[str]:
    """Technique.requires is what the loader checks (a config choosing SparseLoCo needs Subspace Models
    registered): an import of another technique's code is such a dependency, so it must be declared."""
    names, bad = techniques(root), set()
    for module, path in modules(root).items():
        src = area(module)
        if src not in names:
            continue
        for name in all_imports(path, root)[1]:
            dst = area(name)
            if dst in names and dst != src and dst not in declared_requires(root, src):
                bad.add(f"{module} imports {name}, but {src}'s Technique does not list {dst!r} in `requires`")
    return sorted(bad)


def shape_problems(folder: Path, name: str) -> List[str]:
    """A technique package's one shape: its files, `technique` exported from technique.py by __init__.py, and
    the paper mapped to code in __init__.py's docstring."""
    bad = [f"{folder}: no {f}" for f in TECHNIQUE_FILES if not (folder / f).is_file()]
    if bad:
        return bad
    init = ast.parse((folder / "__init__.py").read_text())
    doc = ast.get_docstring(init) or ""
    if not ("Paper" in doc and "->" in doc):
        bad.append(f"{folder}/__init__.py must map the paper to functions ('Paper ... -> ...')")
    if not any(isinstance(n, ast.ImportFrom) and n.module == f"{name}.technique" and
               any(a.name == "technique" for a in n.names) for n in init.body):
        bad.append(f"{folder}/__init__.py must export `technique` from {name}.technique (its entry point)")
    return bad


def entry_point_problems(root: Path) -> List[str]:
    """Every technique-shaped package is declared, with its one Technique object, and has the one shape."""
    declared = entry_points(root)
    bad = []
    if declared.get("core") != "nanotron_ext.models.technique:technique":  # the core registers the same way
        bad.append(f"the core's entry point is {declared.get('core')!r}, not nanotron_ext.models.technique:technique")
    for name in sorted(technique_folders(root) | techniques(root)):
        if declared.get(name) != f"nanotron_ext.{name}:technique":
            bad.append(f"nanotron_ext/{name} is not declared in pyproject.toml as nanotron_ext.{name}:technique")
        bad += shape_problems(root / "nanotron_ext" / name, f"nanotron_ext.{name}")
    return bad


def technique_configs_in_core(root: Path) -> List[str]:
    """The core's config knows the core only: every dataclass under nanotron_ext/config/ is a core section
    (an Extensible with a path), and no class there shares a name with a technique's config.py class."""
    bad = []
    core = {}
    for path in (root / "nanotron_ext" / "config").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            core[node.name] = path.name
            if any("dataclass" in ast.unparse(d) for d in node.decorator_list) and \
                    not any(isinstance(b, ast.Name) and b.id == "Extensible" for b in node.bases):
                bad.append(f"config dataclass outside the core sections: {path.name}: {node.name}")
    for name in sorted(techniques(root)):
        config = root / "nanotron_ext" / name / "config.py"
        for node in ast.parse(config.read_text()).body if config.exists() else ():
            if isinstance(node, ast.ClassDef) and node.name in core:
                bad.append(f"{name}'s section {node.name} also lives in nanotron_ext/config/{core[node.name]}")
    return bad


def bench_imports_of_techniques(root: Path) -> List[str]:
    """nanotron_ext/bench is shared by every paper's scripts: techniques are named by strings and built through
    the registries; paper-specific helpers live in reproduce/<paper>/common.py."""
    names = techniques(root)
    return [f"{m} imports {n}" for m, p in modules(root).items() if area(m) == "bench"
            for n in all_imports(p, root)[1] if area(n) in names]


def technique_sections(root: Path) -> Dict[str, str]:
    """Section path -> technique, read from the `sections = {...}` of each technique's technique.py (the declared
    ones and the toy, which registers in its own tests' processes)."""
    files = {name: root / "nanotron_ext" / name / "technique.py" for name in techniques(root)} | {
        "toy": TOY / "technique.py"}
    out: Dict[str, str] = {}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())) if path.exists() else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                    any(isinstance(t, ast.Name) and t.id == "sections" for t in node.targets):
                out.update({k.value: name for k in node.value.keys if isinstance(k, ast.Constant)})
    return out


def core_names_of_technique_keys(root: Path) -> List[str]:
    """A string literal in core code (outside PAPER_CATALOGUES) that starts with a technique's section path and a
    dot, or is a dotted section path itself ("sparseloco" alone is also the DP sync's name, so it is not)."""
    sections, names, bad = technique_sections(root), techniques(root), []
    for module, path in sorted(modules(root).items()):
        where = path.relative_to(root).as_posix()
        if area(module) in names or where in PAPER_CATALOGUES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            hit = next((s for s in sections if text and (text.startswith(s + ".") or ("." in s and text == s))), None)
            if hit:
                bad.append(f"{where}:{node.lineno} names {sections[hit]}'s key {text!r}: declare it on the Technique")
    return bad


def every_rule(root: Path) -> List[str]:
    graph = package_graph(root)
    return (file_loops(root, ALLOWED_FILE_EDGES) + [describe_cycle(c, graph) for c in cycles(graph)]
            + core_imports_of_techniques(root) + undeclared_requires(root) + entry_point_problems(root)
            + technique_configs_in_core(root) + bench_imports_of_techniques(root) + core_names_of_technique_keys(root))


# -- this tree keeps them -----------------------------------------------------------------------------------------
def test_no_file_level_import_loop_but_the_config_loaders() -> None:
    """A loop between two files is a function in the wrong file (issue 44 moved check_init_from into
    hf/folder.py, run_overrides beside the WAN meter's systems, TIERS into its presets)."""
    loops = file_loops(ROOT, ALLOWED_FILE_EDGES)
    assert not loops, "\n".join(loops)


def test_no_import_cycle_between_packages_at_any_level() -> None:
    """Function-level imports count: a lazy import that closes a loop is still a loop (registry.py reaching up
    into metrics/, bench/ and config/ once closed one through 11 packages)."""
    graph = package_graph(ROOT)
    found = cycles(graph)
    assert not found, "\n".join(describe_cycle(c, graph) for c in found)


def test_the_technique_list_is_the_entry_points() -> None:
    """The packages read from pyproject.toml are the ones the registry loads from the installed entry points (the
    core's own aside): no list is kept here, and a sixth declared there is a technique to every rule."""
    import importlib.metadata

    installed = {ep.value.split(":")[0].split(".")[1] for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                 if ep.value.startswith("nanotron_ext.") and ep.name != "core"}
    assert techniques(ROOT) == installed and len(installed) >= 5, (techniques(ROOT), installed)
    assert core_area(ROOT) == "models" and "bench" not in techniques(ROOT)


def test_core_never_imports_a_technique_and_techniques_only_where_papers_build_on_each_other() -> None:
    bad = core_imports_of_techniques(ROOT)
    assert not bad, "\n".join(bad)


def test_a_technique_that_imports_another_declares_it_in_requires() -> None:
    bad = undeclared_requires(ROOT)
    assert not bad, "\n".join(bad)


def test_parallel_does_not_import_config() -> None:
    bad = [f"{m} imports {n}" for m, p in modules(ROOT).items() if area(m) == "parallel"
           for n in all_imports(p, ROOT)[1] if area(n) == "config"]
    assert not bad, "\n".join(bad)


def test_every_technique_package_is_an_entry_point_with_the_one_shape_and_a_paper_map() -> None:
    bad = entry_point_problems(ROOT)
    assert not bad, "\n".join(bad)


def test_the_toy_technique_has_the_in_tree_shape() -> None:
    """tests/toy_technique/ ships as a third-party package would, in the same shape as the in-tree five."""
    bad = shape_problems(ROOT / "tests" / "toy_technique" / "toy_technique", "toy_technique")
    assert not bad, "\n".join(bad)


def test_no_technique_config_lives_in_the_core_config_package() -> None:
    bad = technique_configs_in_core(ROOT)
    assert not bad, "\n".join(bad)


def test_the_bench_harness_is_core_and_imports_no_technique() -> None:
    bad = bench_imports_of_techniques(ROOT)
    assert not bad, "\n".join(bad)


def test_core_code_names_no_technique_key_but_in_the_paper_catalogues() -> None:
    """The core learns what it needs about a technique's keys from the Technique (the resume check, the model
    clock's widths, the uncompressed twin); the sections read here are the ones the registry mounts."""
    from nanotron_ext.registry import techniques as registered

    read = technique_sections(ROOT)
    assert {p for p, name in read.items() if name != "toy"} == {path for t in registered() for path in t.sections}
    assert {p for p, name in read.items() if name == "toy"} == {"model.codec.toy", "toy_sync"}
    bad = core_names_of_technique_keys(ROOT)
    assert not bad, "\n".join(bad)


def floor_problems(root: Path, architecture: str) -> List[str]:
    """ARCHITECTURE.md's floors hold: no running import (inside functions too) reaches a higher floor, and every
    package of the core is on one (a top-level module that is not is a command line: the top floor)."""
    para = " ".join(architecture[architecture.index("**The floors**"):].split(". ")[0].split())
    floors = [re.findall(r"`([^`]+)`", f) for f in para.split("(each imports only below it):")[1].split(";")]
    level = {unit: i for i, floor in enumerate(floors) for unit in floor}
    known, names = modules(root), techniques(root)

    def unit(module: str) -> Optional[str]:
        parts = module.split(".")
        if len(parts) < 2 or parts[1] == "__init__" or parts[1] in names:
            return None
        return parts[1] + "/" if (root / "nanotron_ext" / parts[1]).is_dir() else parts[1] + ".py"

    bad = {f"{u} is on no floor of ARCHITECTURE.md" for m in known if (u := unit(m)) and u.endswith("/")
           and u not in level}
    for module, path in known.items():
        src = unit(module)
        for name in all_imports(path, root)[2] if src else ():
            dst = unit(resolve(name, known))
            if dst and level.get(dst, len(floors)) > level.get(src, len(floors)):
                bad.add(f"{module} imports {name}: {dst} is on a floor above {src} (ARCHITECTURE.md)")
    return sorted(bad)


def test_the_floors_of_architecture_md_hold() -> None:
    """The floors are read from ARCHITECTURE.md, so the map and the code cannot drift apart (config/ once sat
    below cli_flags.py there, and a function-level import hid the climb)."""
    bad = floor_problems(ROOT, (ROOT / "ARCHITECTURE.md").read_text())
    assert not bad, "\n".join(bad)
    climbing = (ROOT / "ARCHITECTURE.md").read_text().replace("`cli_checks.py`, `cli_flags.py`; `config/`",
                                                              "`config/`; `cli_checks.py`, `cli_flags.py`")
    assert "nanotron_ext.config.loader imports nanotron_ext.cli_flags: cli_flags.py is on a floor above config/ " \
           "(ARCHITECTURE.md)" in floor_problems(ROOT, climbing)


def test_no_python_file_over_450_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for p in list(PKG.rglob("*.py")) + list((ROOT / "reproduce").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, "split these files: " + ", ".join(long)


# -- the rules see what they are for: a temporary tree -----------------------------------------------------------
def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_walkers_see_function_level_loops_and_skip_type_checking(tmp_path: Path) -> None:
    """A loop closed inside a function is found and printed, between packages and between files; one closed under
    TYPE_CHECKING is not; without its allowance the config loader's pair is found."""
    assert any("nanotron_ext.config.compose" in line and "nanotron_ext.config.schema" in line
               for line in file_loops(ROOT))
    _write(tmp_path, {
        "nanotron_ext/__init__.py": "", "nanotron_ext/a/__init__.py": "", "nanotron_ext/b/__init__.py": "",
        "nanotron_ext/c/__init__.py": "",
        "nanotron_ext/a/x.py": "from nanotron_ext.b import y\n",
        "nanotron_ext/b/y.py": "def f():\n    from nanotron_ext.a import x\n",
        "nanotron_ext/c/z.py": "from typing import TYPE_CHECKING\nfrom nanotron_ext.a import x\n"
                               "if TYPE_CHECKING:\n    from nanotron_ext.c import z\n",
        "nanotron_ext/b/w.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from nanotron_ext.c import z\nelse:\n    z = None\n",
        # v -> u for annotations only, u -> v: no file loop
        "nanotron_ext/a/v.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from nanotron_ext.a import u\n",
        "nanotron_ext/a/u.py": "from nanotron_ext.a import v\n",
    })
    graph = package_graph(tmp_path)
    found = cycles(graph)
    text = "\n".join(describe_cycle(c, graph) for c in found)
    assert found == [(["nanotron_ext.a", "nanotron_ext.b", "nanotron_ext.a"], {"nanotron_ext.a", "nanotron_ext.b"})]
    assert "nanotron_ext.b.y imports nanotron_ext.a.x" in text
    assert "nanotron_ext.c" not in graph["nanotron_ext.b"]
    assert file_loops(tmp_path) == ["file-level import loop: nanotron_ext.a.x -> nanotron_ext.b.y -> nanotron_ext.a.x"]


SIXTH = {
    "__init__.py": '"""Sixth: a technique added in a test.\n\nPaper -> code: (none) the codec -> pieces.Sixth\n"""\n'
                   "from nanotron_ext.sixth.technique import technique  # noqa: F401\n",
    "config.py": "import dataclasses\n\n\n@dataclasses.dataclass\nclass SixthConfig:\n    width: int = 4\n",
    "technique.py": "from nanotron_ext.sixth.config import SixthConfig\n"
                    "from nanotron_ext.technique import Technique\n\n\nclass SixthTechnique(Technique):\n"
                    "    name = 'sixth'\n    sections = {'model.codec.sixth': SixthConfig}\n\n\n"
                    "technique = SixthTechnique()\n",
    "pieces.py": "from nanotron_ext.technique import Pieces\n\n\nclass SixthPieces(Pieces):\n    pass\n",
}


def _tree_with_a_sixth(tmp: Path) -> Path:
    """A copy of this tree's sources and pyproject.toml with nanotron_ext/sixth/ declared as an entry point."""
    import shutil

    shutil.copytree(PKG, tmp / "nanotron_ext", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    text = (ROOT / "pyproject.toml").read_text()
    line = 'sparseloco = "nanotron_ext.sparseloco:technique"\n'
    assert line in text
    (tmp / "pyproject.toml").write_text(text.replace(line, line + 'sixth = "nanotron_ext.sixth:technique"\n'))
    _write(tmp, {f"nanotron_ext/sixth/{name}": body for name, body in SIXTH.items()})
    return tmp


def test_a_sixth_technique_is_checked_by_every_rule_without_editing_a_test(tmp_path: Path) -> None:
    """A sixth in-tree technique, declared in (a copy of) pyproject.toml, is a technique to every rule: well
    formed it passes; the core importing it, it importing another technique undeclared, a section of it in the
    core's config, core code naming its key, a file of its shape missing, or a seventh package without its entry
    point, each is named."""
    root = _tree_with_a_sixth(tmp_path)
    assert "sixth" in techniques(root) and every_rule(root) == []
    _write(root, {
        "nanotron_ext/models/bad.py": "def build():\n    from nanotron_ext.sixth import pieces\n",
        "nanotron_ext/sixth/extra.py": "def f():\n    from nanotron_ext.subspace import basis\n",
        "nanotron_ext/config/leak.py": "class SixthConfig:\n    pass\n",
        "nanotron_ext/train/knows.py": "WIDTH = 'model.codec.sixth.width'\n",
        "nanotron_ext/seventh/__init__.py": "", "nanotron_ext/seventh/technique.py": "",
    })
    (root / "nanotron_ext" / "sixth" / "pieces.py").unlink()
    found = "\n".join(every_rule(root))
    for expected in ("core module nanotron_ext.models.bad imports technique nanotron_ext.sixth.pieces",
                     "technique nanotron_ext.sixth.extra imports technique nanotron_ext.subspace.basis",
                     "nanotron_ext.sixth.extra imports nanotron_ext.subspace.basis, but sixth's Technique does not "
                     "list 'subspace' in `requires`",
                     "sixth's section SixthConfig also lives in nanotron_ext/config/leak.py",
                     "nanotron_ext/sixth: no pieces.py",
                     "nanotron_ext/train/knows.py:1 names sixth's key 'model.codec.sixth.width'",
                     "nanotron_ext/seventh is not declared in pyproject.toml"):
        assert expected in found, found


def test_the_bench_index_names_every_module() -> None:
    """nanotron_ext/bench/__init__.py is the harness's index (ARCHITECTURE.md sends readers there first): every module
    and sub-package of bench/ has its line, and so has every module of bench/wan/ in wan/__init__.py."""
    for folder in (PKG / "bench", PKG / "bench" / "wan"):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        listed = {line.split()[0].rstrip("/") for line in doc.splitlines() if line.startswith("    ") and line.split()}
        present = {p.stem for p in folder.glob("*.py") if not p.name.startswith("__")} | {
            p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        missing = sorted(present - listed)
        assert not missing, f"{folder.relative_to(ROOT)}/__init__.py's index does not name: {', '.join(missing)}"
