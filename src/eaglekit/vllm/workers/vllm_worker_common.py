"""Stdlib-only pieces shared by the vLLM workers (`vllm_worker.py`, `vllm_capture_worker.py`) and eaglekit.

The workers run inside vLLM's own Python, which cannot import eaglekit; they are started as scripts, so this
file, beside them, is importable there by its bare name (`import vllm_worker_common`), and here as
`eaglekit.vllm.workers.vllm_worker_common`. Keep it stdlib-only.
"""

from __future__ import annotations

import json
import os
from typing import Any


class JsonlTail:
    """Complete lines appended to a file since the last read (a partial last line waits for its newline)."""

    def __init__(self, path: str | os.PathLike):
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def error_text(error: BaseException) -> str:
    """The exception's own words, with the causes vLLM chained to it (at most three)."""
    parts = [f"{type(error).__name__}: {error}"]
    cause = error.__cause__ or error.__context__
    while cause is not None and len(parts) < 4:
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)
