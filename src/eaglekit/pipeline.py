"""Resumable multi-stage runs: skip what is finished and unchanged, redo what changed and what follows.

Each step runs one stage into its own folder. Its *key* hashes the stage's resolved config, a
fingerprint of its input files (`inputs`) and the keys of the steps it reads from (`after`; by default
the step before it), so a changed option or input re-runs that step and every step that depends on it.

- `<dir>/.run-key` is written when the step starts; a step whose folder holds the same key is
  resumed in place (stages resume their own partial work: regen, extract and train do).
- `<dir>/.run-done` is written when the step finished, with the digest of the step's manifest.json; same key
  there (and the step's `outputs` still present) -> the step is skipped, unless another command has written
  into the folder since (its manifest changed): that is refused with the reason, never taken for the run's.
- A folder holding another key is moved aside to `<dir>.old` (replacing any earlier one) before the
  step runs again, so finished work is never silently mixed with work from other options.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from eaglekit.config import to_dict
from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_json, data_hash, file_sha256

log = logging.getLogger("eaglekit.run")

# files up to this size are hashed whole; larger ones (model weights, shards) by name and size only
HASH_LIMIT = 16 << 20


@dataclass
class Step:
    """One stage of a run: `make_config()` builds the stage's config object, `execute(config)` runs it."""

    name: str
    directory: Path
    make_config: Callable[[], Any]
    execute: Callable[[Any], Any]
    after: tuple[str, ...] | None = None  # names of the steps whose outputs it reads; None = the step before
    inputs: tuple[str | Path, ...] = ()  # files or folders outside the run whose contents are part of the key
    outputs: tuple[str, ...] = ()  # files (relative to `directory`) that a finished step must still have


@dataclass
class StepRecord:
    name: str
    status: str  # "ran" | "skipped"
    seconds: float
    key: str
    directory: Path | None = None
    result: Any = field(default=None, repr=False)
    peak_gpu_bytes: int | None = None  # most GPU memory torch held during the step (in this process); None = no GPU


def _gpu_peak(reset: bool) -> int | None:
    """Peak GPU bytes allocated since the last reset, where this process already uses CUDA (never starts it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak = max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    if reset:
        for d in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(d)
    return peak


def fingerprint(paths: Iterable[str | Path]) -> str:
    """Hash of files/folders: small files by content, large ones by name and size; hidden files ignored."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file()
                           and not any(p.startswith(".") for p in f.relative_to(path).parts))
        elif path.is_file():
            files = [path]
        else:
            digest.update(f"{path}:missing\n".encode())
            continue
        for file in files:
            size = file.stat().st_size
            content = file_sha256(file) if size <= HASH_LIMIT else "large"
            digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}:{size}:{content}\n".encode())
    return digest.hexdigest()[:16]


def step_key(config: Any, previous: str | list[str], inputs: str = "") -> str:
    return data_hash({"config": to_dict(config), "previous": previous, "inputs": inputs})


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}  # a damaged marker counts as absent: the step runs again
    return data if isinstance(data, dict) else {}


def _read_key(path: Path) -> str | None:
    return _read_marker(path).get("key")


def _previous(step: Step, keys: dict[str, str], last: str) -> str | list[str]:
    if step.after is None:
        return last
    missing = [name for name in step.after if name not in keys]
    if missing:
        raise EaglekitError(f"step {step.name} reads from {', '.join(missing)}, which this run does not have before it")
    return [keys[name] for name in step.after]


def _move_aside(step: Step) -> None:
    aside = step.directory.with_name(step.directory.name + ".old")
    if aside.exists():
        shutil.rmtree(aside)
    log.info("%s: options or inputs changed, moving the old folder to %s", step.name, aside)
    step.directory.rename(aside)


def _manifest_digest(directory: Path) -> str | None:
    """The digest of a step's manifest.json, which every stage writes last: a command run into the folder later
    rewrites it."""
    path = directory / "manifest.json"
    return file_sha256(path) if path.is_file() else None


def _check_unchanged(step: Step, marker: dict[str, Any]) -> None:
    """A finished step's folder must still hold what the run wrote there: one that a stage run by hand has written
    into since (an export of another drafter or format, ...) is refused with the reason, never skipped as the run's."""
    if "manifest_sha256" not in marker or _manifest_digest(step.directory) == marker["manifest_sha256"]:
        return
    from eaglekit.manifest import read_manifest

    written = read_manifest(step.directory) or {}
    by = f" by `eaglekit {written['stage']}` at {written.get('finished_at')}" if written.get("stage") else ""
    raise EaglekitError(f"{step.name}: {step.directory} was written again{by} after this run finished it (its "
                        "manifest.json changed): move that folder elsewhere (or delete it) and re-run; the run then "
                        "writes it again")


def run_steps(steps: list[Step]) -> list[StepRecord]:
    """Run `steps` in order, skipping finished unchanged ones. Returns what happened to each."""
    records: list[StepRecord] = []
    keys: dict[str, str] = {}
    cache: dict[tuple[str, ...], str] = {}
    last = ""
    for step in steps:
        config = step.make_config()
        inputs = tuple(str(p) for p in step.inputs)
        if inputs and inputs not in cache:
            cache[inputs] = fingerprint(inputs)
        key = step_key(config, _previous(step, keys, last), cache.get(inputs, ""))
        keys[step.name] = last = key
        done, started = step.directory / ".run-done", step.directory / ".run-key"
        complete = all((step.directory / name).exists() for name in step.outputs)
        marker = _read_marker(done)
        if marker.get("key") == key and complete:
            _check_unchanged(step, marker)
            log.info("%s: finished earlier with the same options, skipped", step.name)
            records.append(StepRecord(step.name, "skipped", float(marker.get("seconds", 0.0)), key, step.directory,
                                      peak_gpu_bytes=marker.get("peak_gpu_bytes")))
            continue
        if step.directory.exists() and _read_key(started) != key:
            _move_aside(step)
        done.unlink(missing_ok=True)
        step.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(started, {"key": key})
        log.info("%s: running", step.name)
        _gpu_peak(reset=True)
        start = time.perf_counter()
        result = step.execute(config)
        seconds = time.perf_counter() - start
        peak = _gpu_peak(reset=True)  # a stage under torchrun runs in other processes: not seen here
        atomic_write_json(done, {"key": key, "seconds": seconds, "peak_gpu_bytes": peak,
                                 "manifest_sha256": _manifest_digest(step.directory)})
        records.append(StepRecord(step.name, "ran", seconds, key, step.directory, result, peak))
    return records
