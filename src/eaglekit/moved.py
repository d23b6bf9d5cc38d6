"""The module paths of eaglekit's earlier layout, importable for one more release (each import warns, naming the new
path): `eaglekit.target.*` (now `eaglekit.targets`, and `eaglekit.generation` for regen and the server) and
`eaglekit.draft.model` (now `eaglekit.drafters.eagle3.model`), as the README and docs showed them.

An import of an old path gives the module at the new path itself (the same object, so classes compare equal);
`install()` runs when `eaglekit` is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

TARGETS = ("capture", "extract", "identity", "inspection", "loading", "output_head", "shard_writer", "store", "verify")
GENERATION = ("backends", "regen", "server", "server_api", "server_jobs", "server_text")
MOVED = {  # old module path -> new
    "eaglekit.target": "eaglekit.targets",
    **{f"eaglekit.target.{name}": f"eaglekit.targets.{name}" for name in TARGETS},
    **{f"eaglekit.target.{name}": f"eaglekit.generation.{name}" for name in GENERATION},
    "eaglekit.draft": "eaglekit.drafters",
    "eaglekit.draft.model": "eaglekit.drafters.eagle3.model",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path before the file system does, and hands out the new module in its place."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: Any) -> None:
        return None  # a throwaway module: exec_module puts the real one in sys.modules

    def exec_module(self, module: Any) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        warnings.warn(f"{old} moved to {new}; the old path is removed in the next release", DeprecationWarning,
                      stacklevel=2)
        sys.modules[old] = importlib.import_module(new)  # the import system returns what sys.modules holds


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
