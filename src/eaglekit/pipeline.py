"""Resumable multi-stage runs: skip what is finished and unchanged, redo what changed and what follows.

Each step runs one stage into its own folder. Its *key* hashes the stage's resolved config together
with the key of the step before it, so a changed option re-runs that step and every later one.

- `<dir>/.run-key` is written when the step starts; a step whose folder holds the same key is
  resumed in place (stages resume their own partial work: regen, extract and train do).
- `<dir>/.run-done` is written when the step finished; same key there -> the step is skipped.
- A folder holding another key is moved aside to `<dir>.old` (replacing any earlier one) before the
  step runs again, so finished work is never silently mixed with work from other options.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eaglekit.config import to_dict
from eaglekit.manifest import atomic_write_json

log = logging.getLogger("eaglekit.run")


@dataclass
class Step:
    """One stage of a run: `make_config(previous_results)` builds the stage's config object."""

    name: str
    directory: Path
    make_config: Callable[[], Any]
    execute: Callable[[Any], Any]


@dataclass
class StepRecord:
    name: str
    status: str  # "ran" | "skipped"
    seconds: float
    key: str
    result: Any = field(default=None, repr=False)


def step_key(config: Any, previous_key: str) -> str:
    data = json.dumps({"config": to_dict(config), "previous": previous_key}, sort_keys=True, default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _read_key(path: Path) -> str | None:
    return json.loads(path.read_text()).get("key") if path.is_file() else None


def run_steps(steps: list[Step]) -> list[StepRecord]:
    """Run `steps` in order, skipping finished unchanged ones. Returns what happened to each."""
    records: list[StepRecord] = []
    previous = ""
    for step in steps:
        config = step.make_config()
        key = step_key(config, previous)
        previous = key
        done, started = step.directory / ".run-done", step.directory / ".run-key"
        if _read_key(done) == key:
            log.info("%s: finished earlier with the same options, skipped", step.name)
            records.append(StepRecord(step.name, "skipped", 0.0, key))
            continue
        if step.directory.exists() and _read_key(started) != key:
            aside = step.directory.with_name(step.directory.name + ".old")
            if aside.exists():
                shutil.rmtree(aside)
            log.info("%s: options or inputs changed, moving the old folder to %s", step.name, aside)
            step.directory.rename(aside)
        step.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(started, {"key": key})
        log.info("%s: running", step.name)
        start = time.perf_counter()
        result = step.execute(config)
        seconds = time.perf_counter() - start
        atomic_write_json(done, {"key": key, "seconds": seconds})
        records.append(StepRecord(step.name, "ran", seconds, key, result))
    return records
