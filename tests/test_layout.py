"""The package layout's rules, read from the source with `ast` (nothing is imported):

- no import cycle between nanotron_ext modules (module-level imports);
- the core never imports a technique package, not even lazily inside a function: techniques plug
  in through nanotron_ext.registry and the `nanotron_ext.techniques` entry points;
- a technique imports another only where one paper builds on another;
- parallel/ does not import config/ (primitives take plain values, the config layer reads YAML);
- every technique package is declared as an entry point (its one Technique object) and maps its paper in
  its docstring;
- no technique's config dataclass lives under nanotron_ext/config/ (techniques own their sections).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nanotron_ext"
TECHNIQUES = {"boost", "resbm", "subspace", "mapl", "sparseloco"}
# where one paper builds on another (heterogeneous SparseLoCo on Subspace Models; MAPL's SSN baseline
# is the Subspace Models codec)
ALLOWED_TECHNIQUE_IMPORTS = {("sparseloco", "subspace"), ("mapl", "subspace")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> Tuple[Set[str], Set[str]]:
    """(module-level nanotron_ext imports, all nanotron_ext imports incl. inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = _module_name(path).split(".")
    top: Set[str] = set()
    every: Set[str] = set()

    def names(node: ast.AST) -> List[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            return [mod] + [f"{mod}.{a.name}" for a in node.names]
        return []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            found = [n for n in names(child) if n == "nanotron_ext" or n.startswith("nanotron_ext.")]
            every.update(found)
            guarded = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if not in_function and not guarded:
                top.update(found)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner or guarded)

    visit(tree, False)
    return top, every


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str, modules: Dict[str, Path]) -> str:
    """`from a.b import c` names a.b.c: the module a.b.c if it exists, else a.b."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {m: {_resolve(i, modules) for i in _imports(p)[0]} - {m} for m, p in modules.items()}
    # a package's __init__ importing its own submodules is not a cycle of the submodule importing it back
    state: Dict[str, int] = {}
    stack: List[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in graph:
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                # importing a.b runs a/__init__ first: a package -> its child -> the package is benign
                if not all(x == cycle[0] or x.startswith(cycle[0] + ".") for x in cycle):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)


def test_core_never_imports_a_technique_and_techniques_only_where_papers_build_on_each_other() -> None:
    bad = []
    for module, path in _modules().items():
        src = _area(module)
        for name in _imports(path)[1]:
            dst = _area(name)
            if dst not in TECHNIQUES or dst == src:
                continue
            if src not in TECHNIQUES:
                bad.append(f"core module {module} imports technique {name}")
            elif (src, dst) not in ALLOWED_TECHNIQUE_IMPORTS:
                bad.append(f"technique {module} imports technique {name}")
    assert not bad, "\n".join(bad)


def test_parallel_does_not_import_config() -> None:
    bad = [f"{m} imports {n}" for m, p in _modules().items() if _area(m) == "parallel"
           for n in _imports(p)[1] if _area(n) == "config"]
    assert not bad, "\n".join(bad)


def test_every_technique_package_is_an_entry_point_with_a_paper_map() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["nanotron_ext.techniques"]
    present = {p.name for p in PKG.iterdir() if p.is_dir() and p.name in TECHNIQUES}
    assert present, "no technique package found"
    for name in present:
        assert declared.get(name) == f"nanotron_ext.{name}:technique", f"nanotron_ext/{name} is not declared in pyproject.toml"
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert "Paper" in doc and "->" in doc, f"nanotron_ext/{name}/__init__.py must map the paper to functions"


def test_the_layout_test_sees_a_core_import_of_a_technique(tmp_path: Path) -> None:
    """The walker itself must catch a violation, lazy imports included."""
    f = tmp_path / "nanotron_ext" / "models" / "bad.py"
    f.parent.mkdir(parents=True)
    f.write_text("def build():\n    from nanotron_ext.boost import strategies\n")
    global ROOT
    saved = ROOT
    try:
        ROOT = tmp_path
        top, every = _imports(f)
    finally:
        ROOT = saved
    assert not top and "nanotron_ext.boost.strategies" in every


def test_no_python_file_over_400_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for p in list(PKG.rglob("*.py")) + list((ROOT / "reproduce").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, "split these files: " + ", ".join(long)


def test_the_bench_harness_is_core_and_imports_no_technique() -> None:
    """nanotron_ext/bench is shared by every paper's scripts: techniques are named by strings and
    built through the registries; paper-specific helpers live in reproduce/<paper>/common.py."""
    modules = {m: p for m, p in _modules().items() if _area(m) == "bench"}
    assert modules and "bench" not in TECHNIQUES
    bad = [f"{m} imports {n}" for m, p in modules.items() for n in _imports(p)[1] if _area(n) in TECHNIQUES]
    assert not bad, "\n".join(bad)


def test_no_technique_config_lives_in_the_core_config_package() -> None:
    """The core's config knows the core only: every dataclass under nanotron_ext/config/ is a core section
    (an Extensible with a path), so a technique's options cannot hide there."""
    bad = []
    for path in (PKG / "config").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                if not any(isinstance(b, ast.Name) and b.id == "Extensible" for b in node.bases):
                    bad.append(f"{path.name}: {node.name}")
    assert not bad, "config dataclasses outside the core sections: " + ", ".join(bad)
    names = {n.name for p in (PKG / "config").glob("*.py") for n in ast.parse(p.read_text()).body
             if isinstance(n, ast.ClassDef)}
    technique_sections = {"LowRankConfig", "BoostConfig", "ResBMConfig", "MaplCodecConfig", "SpelConfig",
                          "SubspaceConfig", "SparseLoCoConfig"}
    assert not names & technique_sections, names & technique_sections
