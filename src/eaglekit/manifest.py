"""Atomic file writes and stage manifests (what produced an output: config, versions, input hashes).

A stage writes its outputs to temporary names and renames them into place, so an interrupted run
never leaves a file that a later run would trust. `manifest.json` is written last: its presence
means the stage finished.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from eaglekit.version import __version__

log = logging.getLogger(__name__)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path (`.<name>.<pid>.tmp`: hidden, and found by `.<name>*.tmp`); on success it
    replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it takes the place of `path` (an older `path` is
    moved aside first, then removed), on error it is removed. A reader never sees a half-filled `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier process of this id that was killed
    tmp.mkdir()
    try:
        yield tmp
        aside = path.with_name(f".{path.name}.old{os.getpid()}")
        if path.exists():
            path.rename(aside)
        os.replace(tmp, path)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def data_hash(data: Any) -> str:
    """A stable 16-hex-digit hash of JSON-like data (keys sorted; other objects by str()): configs, run keys."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
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
    atomic_write_json(
        path, {"stage": stage, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "environment": environment(), **data}
    )
    return path


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


OWNER_FILE = ".eaglekit-stage"  # names the stage that writes into a directory, from its start (the manifest comes last)
# eaglekit run's own files in a step folder (markers, the resolved config a torchrun launch reads): they do not
# make a directory "not empty"
BOOKKEEPING = {OWNER_FILE, ".run-key", ".run-done", "launch.yaml"}


def directory_owner(directory: str | Path) -> str | None:
    """The stage that claimed `directory` (its owner file, else its manifest), or None."""
    directory = Path(directory)
    for path in (directory / OWNER_FILE, directory / "manifest.json"):
        try:
            stage = json.loads(path.read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stage, str) and stage:
            return stage
    return None


def claim_output(directory: str | Path, stage: str, overwrite: bool = False) -> Path:
    """Make `directory` the output of `stage`, refusing to write into a file or into a non-empty directory
    that another stage (or no eaglekit stage) wrote, unless `overwrite`. Every stage calls this first;
    re-running or resuming a stage into its own directory is allowed."""
    from eaglekit.errors import EaglekitError

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise EaglekitError(
            f"output {directory} is a file, not a directory: pass output= a directory path "
            "(a new one, or one this stage wrote)"
        )
    owner = directory_owner(directory) if directory.is_dir() else None
    foreign = [p.name for p in directory.iterdir() if p.name not in BOOKKEEPING] if directory.is_dir() else []
    if owner is None and (directory / ".run-key").is_file():
        owner = stage  # a step folder of `eaglekit run` from before owner files: the pipeline made it for this stage
    if owner is None and (directory / "run.yaml").is_file():
        owner = "run"  # a run directory from before owner files (`eaglekit run` saves its resolved config there)
    if foreign and owner != stage:
        written_by = f"was written by `eaglekit {owner}`" if owner else "was not written by eaglekit"
        if not overwrite:
            raise EaglekitError(
                f"output {directory} is not empty and {written_by} (it holds {', '.join(sorted(foreign)[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}): choose a new output directory, or pass "
                "overwrite=true to write into it anyway"
            )
        log.warning("overwrite=true: writing `%s` output into %s, which %s", stage, directory, written_by)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if owner != stage:
            atomic_write_json(directory / OWNER_FILE, {"stage": stage})
    except OSError as error:
        raise EaglekitError(
            f"cannot create output directory {directory}: {error.strerror or error}; "
            "pass output= a path you can write to"
        ) from None
    return directory


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def write_errors(directory: str | Path, what: str = "output") -> Iterator[None]:
    """Turn a full disk or a read-only/forbidden directory met while writing `directory` into one EaglekitError
    naming the directory and the fix (the stage's own cleanup runs first: raise from inside its try/finally)."""
    from eaglekit.errors import EaglekitError

    try:
        yield
    except OSError as error:
        if error.errno in DISK_FULL:
            raise EaglekitError(
                f"disk full while writing the {what} in {directory}: free space there (or pass output= "
                "a directory on another disk), then re-run the same command; finished work is kept"
            ) from None
        if error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise EaglekitError(
                f"cannot write the {what} in {directory} ({error.strerror}): pass output= a directory you can write to"
            ) from None
        raise


def check_output_file(path: str | Path, example: str = "result.json") -> Path:
    """An output FILE path that a stage may write: not an existing directory, its parent not a file."""
    from eaglekit.errors import EaglekitError

    path = Path(path)
    if path.is_dir():
        raise EaglekitError(f"output {path} is a directory; pass output= a file path, e.g. output={path / example}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise EaglekitError(f"output {path}: {parent} is a file, not a directory; choose another output path")
    return path
