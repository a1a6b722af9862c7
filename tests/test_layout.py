"""The package layout's rules, read from the source with `ast` (nothing is imported):

- no import cycle between nanotron_ext modules (module-level imports);
- no import cycle between nanotron_ext packages at any import level: imports inside functions count, those under
  `if TYPE_CHECKING:` do not (a package is nanotron_ext's first sub-package, e.g. nanotron_ext.config; a top-level
  module such as nanotron_ext.registry is its own);
- the core never imports a technique package, not even lazily inside a function: techniques plug
  in through nanotron_ext.registry and the `nanotron_ext.techniques` entry points;
- a technique imports another only where one paper builds on another, and declares it (`Technique.requires`);
- parallel/ does not import config/ (primitives take plain values, the config layer reads YAML);
- every technique package is declared as an entry point (its one Technique object) and maps its paper in
  its docstring;
- no technique's config dataclass lives under nanotron_ext/config/ (techniques own their sections).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nanotron_ext"
TECHNIQUES = {"boost", "resbm", "subspace", "mapl", "sparseloco"}
# where one paper builds on another (heterogeneous SparseLoCo on Subspace Models; MAPL shares only the core's
# codecs/energy.py with it)
ALLOWED_TECHNIQUE_IMPORTS = {("sparseloco", "subspace")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> Tuple[Set[str], Set[str]]:
    """(module-level nanotron_ext imports, all nanotron_ext imports incl. inside functions)."""
    top, every, _ = _all_imports(path)
    return top, every


def _all_imports(path: Path) -> Tuple[Set[str], Set[str], Set[str]]:
    """(module-level nanotron_ext imports, all nanotron_ext imports incl. inside functions, the imports that run:
    all but those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = _module_name(path).split(".")
    top: Set[str] = set()
    every: Set[str] = set()
    runs: Set[str] = set()

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

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            found = [n for n in names(child) if n == "nanotron_ext" or n.startswith("nanotron_ext.")]
            every.update(found)
            guarded = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if not in_function and not guarded:
                top.update(found)
            if not type_only:
                runs.update(found)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if guarded:  # the body is for type checkers only; an `else:` branch runs
                for stmt in child.body:
                    visit_one(stmt, True, True)
                for stmt in child.orelse:
                    visit_one(stmt, inner, type_only)
            else:
                visit(child, inner, type_only)

    def visit_one(stmt: ast.AST, in_function: bool, type_only: bool) -> None:
        holder = ast.Module(body=[stmt], type_ignores=[])
        visit(holder, in_function, type_only)

    visit(tree, False, False)
    return top, every, runs


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


def _package(module: str) -> str:
    """The node of the package graph: nanotron_ext.<first sub-package>, or a top-level module itself."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> Dict[str, Dict[str, List[Tuple[str, str]]]]:
    """package -> {package it imports: [(importing module, imported module), ...]}, imports inside functions
    included, those under `if TYPE_CHECKING:` not."""
    modules = _modules()
    graph: Dict[str, Dict[str, List[Tuple[str, str]]]] = {_package(m): {} for m in modules}
    for module, path in modules.items():
        for name in _all_imports(path)[2]:
            target = _resolve(name, modules)
            src, dst = _package(module), _package(target)
            if src != dst and dst in graph:
                graph[src].setdefault(dst, []).append((module, target))
    return graph


Graph = Dict[str, Dict[str, List[Tuple[str, str]]]]


def _package_cycles(graph: Graph) -> List[Tuple[List[str], Set[str]]]:
    """Per strongly connected group of packages (Tarjan): one cycle through it (first node repeated at the end),
    and the whole group."""
    return [(_cycle_through(graph, group), group) for group in _tangled_groups(graph)]


def _tangled_groups(graph: Graph) -> List[Set[str]]:
    """The strongly connected groups of more than one package (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    groups: List[Set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = _pop_group(stack, v)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def _pop_group(stack: List[str], root: str) -> Set[str]:
    """Pop Tarjan's stack down to `root` (included): one strongly connected group."""
    group = set()
    while True:
        w = stack.pop()
        group.add(w)
        if w == root:
            return group


def _cycle_through(graph: Graph, group: Set[str]) -> List[str]:
    """The shortest way from the group's first package back to itself inside the group (breadth first), the
    first package repeated at the end."""
    start = min(group)
    prev: Dict[str, str] = {}
    frontier, seen, end = [start], {start}, None
    while frontier and end is None:
        frontier, end = _next_frontier(graph, group, start, frontier, seen, prev)
    path = [end]
    while path[-1] != start:
        path.append(prev[path[-1]])
    return list(reversed(path)) + [start]


def _next_frontier(graph: Graph, group: Set[str], start: str, frontier: List[str], seen: Set[str],
                   prev: Dict[str, str]) -> Tuple[List[str], Optional[str]]:
    """One breadth-first step: (the packages first reached from `frontier`, the frontier package with an import
    of `start` or None). Fills `seen` and `prev`."""
    nxt = []
    for v in frontier:
        for w in sorted(graph[v]):
            if w == start:
                return nxt, v
            if w in group and w not in seen:
                seen.add(w)
                prev[w] = v
                nxt.append(w)
    return nxt, None


def _describe_cycle(found: Tuple[List[str], Set[str]], graph: Dict[str, Dict[str, List[Tuple[str, str]]]]) -> str:
    cycle, group = found
    steps = [f"{a} -> {b} ({', '.join(f'{m} imports {n}' for m, n in sorted(set(graph[a][b]))[:3])})"
             for a, b in zip(cycle, cycle[1:])]
    tangled = (f"\n  ({len(group)} packages in this loop: {', '.join(sorted(group))})"
               if len(group) > len(cycle) - 1 else "")
    return "import cycle between packages: " + " -> ".join(cycle) + "\n  " + "\n  ".join(steps) + tangled


def test_no_import_cycle_between_packages_at_any_level() -> None:
    """Function-level imports count: a lazy import that closes a loop is still a loop (registry.py reaching up
    into metrics/, bench/ and config/ once closed one through 11 packages)."""
    graph = _package_graph()
    cycles = _package_cycles(graph)
    assert not cycles, "\n".join(_describe_cycle(c, graph) for c in cycles)


def test_the_package_graph_sees_function_level_cycles_and_skips_type_checking(tmp_path: Path) -> None:
    """The walker itself: a cycle closed inside a function is found and printed; one under TYPE_CHECKING is not."""
    pkg = tmp_path / "nanotron_ext"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from nanotron_ext.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from nanotron_ext.a import x\n")
    (pkg / "c" / "z.py").write_text("from typing import TYPE_CHECKING\nfrom nanotron_ext.a import x\n"
                                    "if TYPE_CHECKING:\n    from nanotron_ext.c import z\n")
    (pkg / "b" / "w.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from nanotron_ext.c import z\nelse:\n    z = None\n")
    global ROOT, PKG
    saved = ROOT, PKG
    try:
        ROOT, PKG = tmp_path, pkg
        graph = _package_graph()
        cycles = _package_cycles(graph)
        text = "\n".join(_describe_cycle(c, graph) for c in cycles)
    finally:
        ROOT, PKG = saved
    assert cycles == [(["nanotron_ext.a", "nanotron_ext.b", "nanotron_ext.a"], {"nanotron_ext.a", "nanotron_ext.b"})]
    assert "nanotron_ext.b.y imports nanotron_ext.a.x" in text
    assert "nanotron_ext.c" not in graph["nanotron_ext.b"]


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


def _declared_requires(technique: str) -> Set[str]:
    """The names in `requires = (...)` of the Technique class in nanotron_ext/<technique>/technique.py."""
    path = PKG / technique / "technique.py"
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())) if path.exists() else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "requires" for t in node.targets):
            out.update(ast.literal_eval(node.value))
    return out


def test_a_technique_that_imports_another_declares_it_in_requires() -> None:
    """Technique.requires is what the loader checks (a config choosing SparseLoCo needs Subspace Models
    registered): an import of another technique's code is such a dependency, so it must be declared."""
    bad = []
    for module, path in _modules().items():
        src = _area(module)
        if src not in TECHNIQUES:
            continue
        for name in _imports(path)[1]:
            dst = _area(name)
            if dst in TECHNIQUES and dst != src and dst not in _declared_requires(src):
                bad.append(f"{module} imports {name}, but {src}'s Technique does not list {dst!r} in `requires`")
    assert not bad, "\n".join(sorted(set(bad)))


def test_parallel_does_not_import_config() -> None:
    bad = [f"{m} imports {n}" for m, p in _modules().items() if _area(m) == "parallel"
           for n in _imports(p)[1] if _area(n) == "config"]
    assert not bad, "\n".join(bad)


def test_every_technique_package_is_an_entry_point_with_a_paper_map() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["nanotron_ext.techniques"]
    # the core's own technique object registers the same way, beside its pieces (models/pieces.py: CorePieces)
    assert declared.get("core") == "nanotron_ext.models.technique:technique", declared
    present = {p.name for p in PKG.iterdir() if p.is_dir() and p.name in TECHNIQUES}
    assert present, "no technique package found"
    for name in present:
        assert declared.get(name) == f"nanotron_ext.{name}:technique", (
            f"nanotron_ext/{name} is not declared in pyproject.toml")
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
