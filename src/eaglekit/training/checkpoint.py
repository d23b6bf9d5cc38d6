"""Training checkpoints: drafter weights + optimizer, scheduler, RNG states and data position.

`output/checkpoints/step-00000120/` is written under a temporary name and renamed into place, then
`output/checkpoints/latest.json` is replaced atomically: a killed run never leaves a checkpoint that
resume would trust half-written.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_directory, atomic_write_json

LATEST = "latest.json"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def save_checkpoint(directory: Path, step: int, drafter_state: dict[str, torch.Tensor], save_drafter: Any,
                    trainer_state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` (drafter via `save_drafter(dir)`, trainer state via torch.save) atomically."""
    final = directory / f"step-{step:08d}"
    with atomic_directory(final) as tmp:  # a full disk, Ctrl-C: no half-written checkpoint is left behind
        save_drafter(tmp)
        torch.save(trainer_state, tmp / "trainer.pt")
    atomic_write_json(directory / LATEST, {"step": step, "path": final.name})
    old = sorted(p for p in directory.glob("step-*") if p.is_dir() and p != final)
    for stale in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / json.loads(pointer.read_text())["path"]
    if not (path / "trainer.pt").is_file():
        raise EaglekitError(f"{pointer} names {path}, which is incomplete; delete {pointer} to resume "
                            "from an older checkpoint")
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
