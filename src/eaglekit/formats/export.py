"""Writing a checkpoint that the engine will read as the drafter it came from: every layout's export stages its files,
re-reads them with its importer and compares probe logits, and only then moves them into place."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from eaglekit.manifest import atomic_path, atomic_write_json

CHECKPOINT_FILES = ("model.safetensors", "config.json")


def write_verified(
    drafter: Any,
    output: Path,
    state: dict[str, torch.Tensor],  # the checkpoint's tensors, under the layout's names
    config: dict[str, Any],  # its config.json
    dtype: torch.dtype,
    reread: Callable[[Path], Any],  # a checkpoint directory -> the drafter its importer builds
    compare: Callable[[Any, Any], float],  # (reference, re-read) -> max probe-logit difference; raises beyond tolerance
) -> float:
    """Write `state` and `config` into a staging folder inside `output`, re-read it, compare with `drafter` (in
    `dtype`, on the CPU), then move the files into place -> the difference. A checkpoint without the embedding gets
    the drafter's for the comparison (the engine shares the target's). Nothing is left in `output` on failure."""
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output, prefix=".export-") as staging:
        staging = Path(staging)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(staging / "config.json", config)
        reloaded = reread(staging)
        reference = copy.deepcopy(drafter).to(device="cpu", dtype=dtype)
        if "embed_tokens.weight" not in state:
            reloaded.load_target_embedding(reference.embed_tokens.weight.detach().cpu())
        difference = compare(reference, reloaded.to(dtype))
        for name in CHECKPOINT_FILES:
            with atomic_path(output / name) as tmp:
                shutil.move(str(staging / name), tmp)
    return difference
