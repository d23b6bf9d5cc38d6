"""Classes of a Python code base resolved across modules with `ast`, never by importing them.

`ModuleIndex` parses modules on demand from one or more `EngineSource`s (the engine, plus plugin
packages), follows `import`/`from ... import` (relative ones too) and module-level aliases
(`Base = LlamaForCausalLM`, preferring the runtime branch of `if TYPE_CHECKING:`), and linearises a
class's bases (C3, like Python) so that methods can be looked up the way Python would find them.
Bases that live outside the sources (torch, typing) stay as plain names.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Iterator, Union

from eaglekit.doctor.source import EngineSource


@dataclass
class ModuleInfo:
    name: str
    path: str  # readable location
    relative: str  # path relative to the source root
    tree: ast.Module
    is_package: bool
    bindings: dict[str, tuple[str, Any]] = field(default_factory=dict)  # local name -> (kind, payload)
    star_imports: list[str] = field(default_factory=list)


@dataclass
class ClassInfo:
    name: str
    module: str
    path: str
    relative: str
    node: ast.ClassDef

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def where(self) -> str:
        return f"{self.relative}:{self.line}"

    def methods(self) -> dict[str, ast.FunctionDef]:
        return {n.name: n for n in self.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def class_attributes(self) -> dict[str, ast.expr]:
        out: dict[str, ast.expr] = {}
        for node in self.node.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                out[node.target.id] = node.value
        return out


MroEntry = Union[ClassInfo, str]  # str: a base outside the indexed sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, descending into if/try; the runtime branch of TYPE_CHECKING comes last (wins)."""
    for node in body:
        if isinstance(node, ast.If):
            if _is_type_checking(node.test):
                yield from _top_statements(node.body)
                yield from _top_statements(node.orelse)
            else:
                yield from _top_statements(node.body)
                yield from _top_statements(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_statements(node.body)
            for handler in node.handlers:
                yield from _top_statements(handler.body)
        else:
            yield node


class ModuleIndex:
    """Parse-on-demand view over the modules of several sources (searched in order)."""

    def __init__(self, sources: list[EngineSource]):
        self.sources = sources
        self._modules: dict[str, ModuleInfo | None] = {}
        self._assignments: dict[tuple[str, str], list[tuple[ClassInfo, ast.expr]]] = {}
        self.memo: dict[str, Any] = {}  # what callers read from these modules once, by the name of what read it

    # --- modules ----------------------------------------------------------------------------
    def module(self, name: str) -> ModuleInfo | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> ModuleInfo | None:
        base = name.replace(".", "/")
        for source in self.sources:
            for relative, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = source.read(relative)
                if text is None:
                    continue
                try:
                    tree = ast.parse(text)
                except SyntaxError:
                    return None
                info = ModuleInfo(name, source.location(relative), relative, tree, is_package)
                self._bind(info)
                return info
        return None

    def _absolute(self, info: ModuleInfo, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        package = info.name if info.is_package else info.name.rsplit(".", 1)[0]
        for _ in range(level - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{module}" if module else package

    def _bind(self, info: ModuleInfo) -> None:
        for node in _top_statements(info.tree.body):
            if isinstance(node, ast.ClassDef):
                info.bindings[node.name] = ("class", node)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(info, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        info.star_imports.append(source)
                    else:
                        info.bindings[alias.asname or alias.name] = ("from", (source, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        info.bindings[alias.asname] = ("module", alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        info.bindings[top] = ("module", top)
            elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        info.bindings[target.id] = ("alias", node.value)

    # --- names ------------------------------------------------------------------------------
    def resolve_in(self, module: str, name: str, depth: int = 0) -> ClassInfo | None:
        """The class that `name` refers to inside `module`."""
        info = self.module(module)
        if info is None or depth > 12:
            return None
        binding = info.bindings.get(name)
        if binding is None:
            for star in info.star_imports:
                found = self.resolve_in(star, name, depth + 1)
                if found is not None:
                    return found
            return None
        kind, payload = binding
        if kind == "class":
            return ClassInfo(payload.name, info.name, info.path, info.relative, payload)
        if kind == "from":
            source, attr = payload
            found = self.resolve_in(source, attr, depth + 1)
            return found
        if kind == "alias":
            return self.resolve_expr(module, payload, depth + 1)
        return None

    def resolve_expr(self, module: str, expr: ast.expr, depth: int = 0) -> ClassInfo | None:
        """Resolve `Name`, `module.Name` or `pkg.mod.Name` expressions written in `module`."""
        if isinstance(expr, ast.Name):
            return self.resolve_in(module, expr.id, depth)
        if isinstance(expr, ast.Subscript):  # Generic[...] style bases
            return self.resolve_expr(module, expr.value, depth)
        if isinstance(expr, ast.Attribute):
            parts: list[str] = []
            node: ast.expr = expr
            while isinstance(node, ast.Attribute):
                parts.insert(0, node.attr)
                node = node.value
            if not isinstance(node, ast.Name):
                return None
            info = self.module(module)
            binding = info.bindings.get(node.id) if info else None
            if binding is None:
                return None
            if binding[0] == "module":
                target = binding[1]
            elif binding[0] == "from":
                target = f"{binding[1][0]}.{binding[1][1]}"
            else:
                return None
            dotted = ".".join([target] + parts[:-1])
            return self.resolve_in(dotted, parts[-1], depth + 1)
        return None

    def resolve_in_class(self, cls: ClassInfo, expr: ast.expr) -> ClassInfo | None:
        """Like `resolve_expr`, also honouring `from x import Name` statements inside the class's methods."""
        found = self.resolve_expr(cls.module, expr)
        if found is not None or not isinstance(expr, ast.Name):
            return found
        info = self.module(cls.module)
        for node in ast.walk(cls.node):
            if isinstance(node, ast.ImportFrom) and info is not None:
                for alias in node.names:
                    if (alias.asname or alias.name) == expr.id:
                        return self.resolve_in(self._absolute(info, node.module, node.level), alias.name)
        return None

    def find_class(self, module: str, name: str) -> ClassInfo | None:
        return self.resolve_in(module, name)

    # --- hierarchy --------------------------------------------------------------------------
    def bases(self, cls: ClassInfo) -> list[MroEntry]:
        out: list[MroEntry] = []
        for base in cls.node.bases:
            resolved = self.resolve_expr(cls.module, base)
            out.append(resolved if resolved is not None else ast.unparse(base))
        return out

    def mro(self, cls: ClassInfo, depth: int = 0) -> list[MroEntry]:
        """C3 linearisation (falls back to depth-first order when C3 fails, as on a bad hierarchy)."""
        if depth > 40:
            return [cls]
        bases = self.bases(cls)
        sequences = [self.mro(b, depth + 1) if isinstance(b, ClassInfo) else [b] for b in bases] + [list(bases)]
        result: list[MroEntry] = [cls]
        key = lambda entry: entry.key if isinstance(entry, ClassInfo) else f"external:{entry}"  # noqa: E731
        sequences = [[e for e in s] for s in sequences if s]
        while sequences:
            for sequence in sequences:
                head = sequence[0]
                if not any(key(head) in {key(e) for e in other[1:]} for other in sequences):
                    break
            else:  # inconsistent: depth-first fallback
                seen = {key(e) for e in result}
                for sequence in sequences:
                    for entry in sequence:
                        if key(entry) not in seen:
                            result.append(entry)
                            seen.add(key(entry))
                return result
            result.append(head)
            sequences = [[e for e in s if key(e) != key(head)] for s in sequences]
            sequences = [s for s in sequences if s]
        return result

    def find_method(self, cls: ClassInfo, name: str,
                    skip: tuple[str, ...] = ()) -> tuple[ClassInfo, ast.FunctionDef] | None:
        """First definition of `name` along the MRO (classes named in `skip` are passed over)."""
        for entry in self.mro(cls):
            if isinstance(entry, ClassInfo) and entry.name not in skip:
                method = entry.methods().get(name)
                if method is not None:
                    return entry, method
        return None

    def self_assignments(self, cls: ClassInfo, attribute: str) -> list[tuple[ClassInfo, ast.expr]]:
        """`self.<attribute> = value` statements in any method along the MRO, most derived first."""
        if (cls.key, attribute) not in self._assignments:
            self._assignments[(cls.key, attribute)] = self._self_assignments(cls, attribute)
        return self._assignments[(cls.key, attribute)]

    def _self_assignments(self, cls: ClassInfo, attribute: str) -> list[tuple[ClassInfo, ast.expr]]:
        found = []
        for entry in self.mro(cls):
            if not isinstance(entry, ClassInfo):
                continue
            for method in entry.methods().values():
                for node in ast.walk(method):
                    targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                               if isinstance(node, ast.AnnAssign) and node.value else [])
                    for target in targets:
                        if (isinstance(target, ast.Attribute) and target.attr == attribute
                                and isinstance(target.value, ast.Name) and target.value.id == "self"):
                            found.append((entry, node.value))
        return found


def mentions(node: ast.AST, needles: tuple[str, ...]) -> list[str]:
    """Identifiers and attribute names in `node` that contain any of `needles`."""
    hits = []
    for child in ast.walk(node):
        name = child.id if isinstance(child, ast.Name) else child.attr if isinstance(child, ast.Attribute) else None
        if name and any(n in name for n in needles):
            hits.append(name)
    return sorted(set(hits))


def is_stub(function: ast.FunctionDef) -> bool:
    """True for a body of only a docstring, `...`, `pass` or `raise NotImplementedError`."""
    for node in function.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Pass):
            continue
        if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node):
            continue
        return False
    return True


def string_lists(node: ast.AST) -> list[list[str]]:
    """Every list/tuple literal of strings inside `node` (e.g. `architectures=["Llama4ForCausalLM"]`)."""
    out = []
    for child in ast.walk(node):
        if isinstance(child, (ast.List, ast.Tuple)) and child.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in child.elts):
            out.append([e.value for e in child.elts])
    return out


def evaluate_layers(expr: ast.expr, num_layers: int | None) -> tuple[int, ...] | None:
    """Evaluate a default-layers expression like `(2, num_layers // 2, num_layers - 3)` for L layers."""
    def value(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if num_layers is None:
            raise ValueError("layer count unknown")
        if isinstance(node, ast.Name) and "layer" in node.id:
            return num_layers
        if isinstance(node, ast.Attribute) and "layers" in node.attr:
            return num_layers
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
            return num_layers
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            ops = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
                   ast.FloorDiv: lambda: left // right, ast.Mult: lambda: left * right}
            if type(node.op) in ops:
                return ops[type(node.op)]()
        raise ValueError(ast.unparse(node))
    if not isinstance(expr, (ast.Tuple, ast.List)):
        return None
    try:
        return tuple(value(e) for e in expr.elts)
    except (ValueError, ZeroDivisionError):
        return None
