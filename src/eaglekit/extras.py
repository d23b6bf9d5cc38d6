"""The optional parts of eaglekit and the packages they need, installed as extras of the package:

    pip install 'eaglekit[data]'       # datasets: prompts and conversations from Hugging Face datasets on disk
    pip install 'eaglekit[plots]'      # matplotlib: bench.png and the run report's plots
    pip install 'eaglekit[multi-gpu]'  # accelerate: device_map=auto (one target spread over several GPUs)

`require` imports one of them or raises one EaglekitError naming the extra to install; `pyplot` gives matplotlib's
pyplot, or None (and one warning) where it is not installed: a run's report is still written, without plots.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

EXTRAS = {"datasets": "data", "matplotlib": "plots", "accelerate": "multi-gpu"}  # package -> the extra holding it
_warned: set[str] = set()


def install_hint(package: str) -> str:
    return f"pip install 'eaglekit[{EXTRAS[package]}]'"


def require(package: str, purpose: str) -> ModuleType:
    """`package` imported, else an EaglekitError: '<purpose> needs <package>, which is not installed: pip install
    'eaglekit[<extra>]''."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise EaglekitError(f"{purpose} needs the `{package}` package, which is not installed: "
                            f"{install_hint(package)}") from None


def pyplot(purpose: str) -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None with one warning (per purpose) when matplotlib is not
    installed."""
    try:
        import matplotlib
    except ImportError:
        if purpose not in _warned:
            _warned.add(purpose)
            log.warning("%s not drawn: matplotlib is not installed (%s)", purpose, install_hint("matplotlib"))
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
