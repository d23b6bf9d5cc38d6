"""The code's lint rules (pyproject.toml [tool.ruff]): lines of at most 120 characters, no unused imports or names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_src_passes():
    try:
        import ruff  # noqa: F401  (the test extra installs it)
    except ImportError:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
