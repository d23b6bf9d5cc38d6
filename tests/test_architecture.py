"""The import structure of `src/eaglekit`: no cycle between modules, none between its top-level packages, and no
import against the direction that docs/CONTRACTS.md's map documents (a package imports only packages below it).

Every `import` statement counts, wherever it is (module level, inside a function, under `TYPE_CHECKING`): a
function-level import that closes a cycle is a cycle that a later refactor turns into an import error.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
CONTRACTS = Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md"
ROOT = "eaglekit"


def _modules(source: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under `source`."""
    found = {}
    for path in sorted((source / ROOT).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules (`a.b.func` -> `a.b`)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imported_modules(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """Our modules that the import statements of `module` name: `import a.b` gives `a.b`; `from a import b` gives
    the module `a.b` when there is one, else `a` (b is a name defined in a)."""
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_resolve(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                found.add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else _resolve(stem, modules))
    return {name for name in found if name is not None and name != module}


@functools.lru_cache(maxsize=2)
def module_graph(source: Path = SOURCE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (itself excluded)."""
    modules = _modules(source)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = _imported_modules(tree, module, path.name == "__init__.py", modules)
    return graph


def package_of(module: str) -> str:
    """`eaglekit.drafters.eagle3.model` -> `draft`; a top-level module is its own node (`eaglekit.config` -> `config`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`a -> b -> ... -> a`) per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first node back to itself, inside the component (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _format(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in found)


def test_cycle_finder_reports_a_cycle_and_accepts_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_graph_sees_function_level_relative_and_submodule_imports(tmp_path):
    package = tmp_path / ROOT
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from eaglekit.sub.low import VALUE\n")
    (package / "sub" / "low.py").write_text("VALUE = 1\n")
    (package / "a.py").write_text("def f():\n    from eaglekit import b  # a submodule, not the package\n")
    (package / "b.py").write_text("from . import a\nfrom .sub import VALUE\n")
    graph = module_graph(tmp_path)
    assert graph["eaglekit.a"] == {"eaglekit.b"}
    assert graph["eaglekit.b"] == {"eaglekit.a", "eaglekit.sub"}
    assert cycles(graph) == [["eaglekit.a", "eaglekit.b", "eaglekit.a"]]
    assert package_graph(graph)["a"] == {"b"} and cycles(package_graph(graph)) == [["a", "b", "a"]]


def test_no_import_cycle_between_modules():
    found = cycles(module_graph())
    print(_format(found))
    assert not found, f"import cycles between modules:\n{_format(found)}"


def test_no_import_cycle_between_packages():
    found = cycles(package_graph(module_graph()))
    print(_format(found))
    assert not found, f"import cycles between the packages of eaglekit:\n{_format(found)}"


def documented_layers(text: str) -> dict[str, int]:
    """Package -> rank from the map block of docs/CONTRACTS.md (the ```text block under "## Map"): the last line is
    rank 0; the packages of one line are separated by commas, their description follows two or more spaces."""
    block = re.search(r"## Map\n.*?```text\n(.*?)```", text, re.S)
    assert block, "docs/CONTRACTS.md lost its map block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    ranks = {}
    for rank, line in enumerate(reversed(lines)):
        names = re.split(r"\s{2,}", line.strip())[0]
        ranks.update({name.strip(): rank for name in names.split(",")})
    return ranks


def against_the_direction(packages: dict[str, set[str]], ranks: dict[str, int]) -> list[str]:
    """Imports from a package to one on its own line or above it in the map."""
    return sorted(f"{source} -> {target}" for source, targets in packages.items() for target in targets
                  if ranks[target] >= ranks[source])


def test_the_direction_checker_reports_upward_and_sideways_imports():
    ranks = documented_layers("## Map\nx\n```text\ntop      t\na, b     ab\nlow      l\n```\n")
    assert ranks == {"top": 2, "a": 1, "b": 1, "low": 0}
    assert against_the_direction({"top": {"a", "low"}, "a": {"low", "b"}, "low": {"top"}}, ranks) == [
        "a -> b", "low -> top"]


def test_every_package_is_on_the_map_and_imports_only_below_itself():
    packages = package_graph(module_graph())
    ranks = documented_layers(CONTRACTS.read_text(encoding="utf-8"))
    missing = sorted(set(packages) - set(ranks))
    assert not missing, f"packages missing from docs/CONTRACTS.md's map: {missing}"
    wrong = against_the_direction(packages, ranks)
    assert not wrong, "imports against the direction of docs/CONTRACTS.md's map:\n" + "\n".join(wrong)
