"""Atomic file writes and stage manifests (what produced an output: config, versions, input hashes).

A stage writes its outputs to temporary names and renames them into place, so an interrupted run
never leaves a file that a later run would trust. `manifest.json` is written last: its presence
means the stage finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from eaglekit import __version__


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def git_commit() -> str | None:
    """The eaglekit checkout's commit: $EAGLEKIT_COMMIT when set (whoever copies a working tree elsewhere,
    e.g. to a GPU box whose copy of .git may be stale, names the tree), else `git rev-parse HEAD`."""
    if os.environ.get("EAGLEKIT_COMMIT"):
        return os.environ["EAGLEKIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def environment() -> dict[str, Any]:
    """Versions and hardware that produced an output."""
    env: dict[str, Any] = {
        "eaglekit": __version__,
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    for name in ("torch", "transformers", "safetensors", "tokenizers"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", None)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    return env


def write_manifest(directory: str | Path, stage: str, data: dict[str, Any]) -> Path:
    """Write `directory/manifest.json` for a finished stage (last, atomically)."""
    path = Path(directory) / "manifest.json"
    atomic_write_json(path, {"stage": stage, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "environment": environment(), **data})
    return path


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())
