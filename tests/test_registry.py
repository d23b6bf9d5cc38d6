"""The drafter-type registry: every registered folder loads and names itself, its methods and hooks resolve, and no
module outside `eaglekit/drafters/` (and the registry) compares anything with a drafter type's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eaglekit import registry
from eaglekit.errors import EaglekitError

SOURCE = Path(__file__).resolve().parents[1] / "src" / "eaglekit"


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_folder_loads_and_its_hooks_resolve(name):
    kind = registry.get(name)
    assert kind.name == name and registry.TYPES[name] == f"eaglekit.drafters.{name.replace('-', '_')}"
    assert kind.methods and all(method in registry.method_names() for method in kind.methods)
    assert kind.drafter_class().__name__.endswith("Drafter")
    for method in kind.methods:
        assert registry.speculative_method(method).name == method
    assert set(kind.export_formats) <= {"vllm", "sglang", "speculators"}
    assert all(marker.path and marker.text for marker in kind.engines.values())


def test_each_method_is_defined_once_and_unknown_names_are_one_error():
    defined = [method.name for name in registry.names() for method in registry.get(name).defines]
    assert len(defined) == len(set(defined)) == len(registry.method_names())
    with pytest.raises(EaglekitError, match="not one this eaglekit knows"):
        registry.get("medusa")
    with pytest.raises(EaglekitError, match="not a speculative method"):
        registry.speculative_method("medusa")


def _type_name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a comparison (==, !=, in, not in) has a drafter type's name as a string literal on a side."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            literals = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(x, ast.Constant) and x.value in names for x in literals):
                found.append(node.lineno)
    return found


def test_no_code_outside_the_drafter_folders_branches_on_a_drafter_type():
    """A new drafter type is one folder and one registry line: the rest of eaglekit asks the registry."""
    names = set(registry.names())
    offenders = {}
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        if relative.startswith("drafters/") or relative == "registry.py":
            continue
        lines = _type_name_comparisons(ast.parse(path.read_text(encoding="utf-8")), names)
        if lines:
            offenders[relative] = lines
    assert not offenders, f"comparisons with a drafter type's name outside eaglekit/drafters/: {offenders}"


def test_the_branch_finder_sees_equality_and_membership():
    tree = ast.parse("a = kind == 'dflash'\nb = kind in ('x', 'p-eagle')\nc = method == 'chain'\n")
    assert _type_name_comparisons(tree, {"dflash", "p-eagle"}) == [1, 2]
