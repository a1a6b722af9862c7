"""The import graph of a nanotron_ext source tree, read with `ast` (nothing is imported), for tests/test_layout.py.

Every function takes the tree's root (the folder holding nanotron_ext/ and pyproject.toml), so the layout rules run
the same on this checkout and on a temporary copy with a package added (a sixth technique, a loop).

Three sets of imports per file: module-level ones (`top`), every one incl. those inside functions (`every`), and
those that run (`runs`: every one but those under `if TYPE_CHECKING:`, which only annotations read).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import tomllib

# package -> {package or module it imports: [(importing module, imported module), ...]}
Graph = Dict[str, Dict[str, List[Tuple[str, str]]]]
ENTRY_POINT_GROUP = "nanotron_ext.techniques"  # (nanotron_ext.registry.ENTRY_POINT_GROUP, not imported here)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_imports(path: Path, root: Path) -> Tuple[Set[str], Set[str], Set[str]]:
    """(module-level nanotron_ext imports, all nanotron_ext imports incl. inside functions, the imports that run:
    all but those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = module_name(path, root).split(".")
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
        visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)

    visit(tree, False, False)
    return top, every, runs


def modules(root: Path) -> Dict[str, Path]:
    return {module_name(p, root): p for p in (root / "nanotron_ext").rglob("*.py")}


def resolve(name: str, known: Dict[str, Path]) -> str:
    """`from a.b import c` names a.b.c: the module a.b.c if it exists, else a.b."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def area(module: str) -> str:
    """nanotron_ext's first sub-package of `module` ("" for nanotron_ext itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package(module: str) -> str:
    """The node of the package graph: nanotron_ext.<first sub-package>, or a top-level module itself."""
    return ".".join(module.split(".")[:2])


# -- which packages are techniques: the entry points, as the registry reads them ---------------------------------
def entry_points(root: Path) -> Dict[str, str]:
    """pyproject.toml's `nanotron_ext.techniques` entry points: name -> "module:object" (what
    nanotron_ext.registry loads once the package is installed)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    return dict(pyproject["project"]["entry-points"][ENTRY_POINT_GROUP])


def core_area(root: Path) -> str:
    """The package that holds the core's own Technique object (entry point `core`: models)."""
    return area(entry_points(root)["core"].split(":")[0])


def techniques(root: Path) -> Set[str]:
    """The in-tree technique packages: every entry point but the core's whose object lives in a package of
    nanotron_ext (`nanotron_ext.<name>...:technique`), by that package's name."""
    core = core_area(root)
    return {area(value.split(":")[0]) for value in entry_points(root).values()
            if value.startswith("nanotron_ext.") and area(value.split(":")[0]) not in ("", core)}


def technique_folders(root: Path) -> Set[str]:
    """The packages of nanotron_ext shaped as a technique (a technique.py beside its __init__), the core's aside:
    what a package added without its entry point would still be."""
    core = core_area(root)
    return {p.parent.name for p in (root / "nanotron_ext").glob("*/technique.py") if p.parent.name != core}


# -- graphs and their loops --------------------------------------------------------------------------------------
def package_graph(root: Path) -> Graph:
    """package -> {package it imports: [(importing module, imported module), ...]}, imports inside functions
    included, those under `if TYPE_CHECKING:` not."""
    known = modules(root)
    graph: Graph = {package(m): {} for m in known}
    for module, path in known.items():
        for name in all_imports(path, root)[2]:
            target = resolve(name, known)
            src, dst = package(module), package(target)
            if src != dst and dst in graph:
                graph[src].setdefault(dst, []).append((module, target))
    return graph


def file_graph(root: Path, allowed: Set[Tuple[str, str]] = frozenset()) -> Graph:
    """module -> {module it imports: [(importer, imported)]}: every import that runs (inside functions too), not
    those under `if TYPE_CHECKING:` (annotations only), minus the `allowed` edges."""
    known = modules(root)
    graph: Graph = {m: {} for m in known}
    for module, path in known.items():
        for name in all_imports(path, root)[2]:
            target = resolve(name, known)
            if target != module and target in graph and (module, target) not in allowed:
                graph[module].setdefault(target, []).append((module, target))
    return graph


def cycles(graph: Graph) -> List[Tuple[List[str], Set[str]]]:
    """Per strongly connected group of nodes (Tarjan): one cycle through it (first node repeated at the end),
    and the whole group."""
    return [(_cycle_through(graph, group), group) for group in _tangled_groups(graph)]


def _tangled_groups(graph: Graph) -> List[Set[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
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
            group = set()
            while True:  # pop the stack down to v: one strongly connected group
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def _cycle_through(graph: Graph, group: Set[str]) -> List[str]:
    """The shortest way from the group's first node back to itself inside the group (breadth first), the first
    node repeated at the end."""
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
    """One breadth-first step: (the nodes first reached from `frontier`, the frontier node with an import of
    `start` or None). Fills `seen` and `prev`."""
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


def describe_cycle(found: Tuple[List[str], Set[str]], graph: Graph) -> str:
    cycle, group = found
    steps = [f"{a} -> {b} ({', '.join(f'{m} imports {n}' for m, n in sorted(set(graph[a][b]))[:3])})"
             for a, b in zip(cycle, cycle[1:])]
    tangled = (f"\n  ({len(group)} packages in this loop: {', '.join(sorted(group))})"
               if len(group) > len(cycle) - 1 else "")
    return "import cycle between packages: " + " -> ".join(cycle) + "\n  " + "\n  ".join(steps) + tangled


def file_loops(root: Path, allowed: Set[Tuple[str, str]] = frozenset()) -> List[str]:
    """One line per loop between files: a cycle through it, and the files tangled with it."""
    out = []
    for cycle, group in cycles(file_graph(root, allowed)):
        rest = sorted(group - set(cycle))
        tangled = f" (also tangled: {', '.join(rest)})" if rest else ""
        out.append("file-level import loop: " + " -> ".join(cycle) + tangled)
    return out
