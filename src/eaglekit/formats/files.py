"""Reading a drafter checkpoint's files in any layout (config.json, weights), and what every layout's writer shares:
dtype names, the target as speculators finds it, the probe-logit tolerance of a round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eaglekit.errors import EaglekitError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def verifier_path(name: str) -> str | None:
    """The target as speculators must find it: eaglekit's 'tiny' alias becomes its directory."""
    if not name:
        return None
    from eaglekit.targets.loading import TINY_TARGET, tiny_target_path

    return str(tiny_target_path()) if name == TINY_TARGET else name


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, a sharded index, or pytorch_model.bin."""
    single = directory / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(directory / shard)))
        return state
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(str(binary), map_location="cpu", weights_only=True)
    raise EaglekitError(f"{directory} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not directory.exists():
        from eaglekit.targets.loading import missing_path_error

        raise missing_path_error(str(directory), "source", "point `source` at a drafter checkpoint directory")
    if not path.is_file():
        raise EaglekitError(f"{directory} has no config.json; point `source` at a drafter checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise EaglekitError(f"{path} is not valid JSON: {error}") from None


def probe_difference(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Max abs difference of a drafter's probe logits and its round-tripped copy's; raises above the tolerance:
    none for fp32 weights (`dtype`), else 1% of the largest expected logit."""
    difference = (expected - got).abs().max().item()
    tolerance = 0.0 if dtype == torch.float32 else 1e-2 * expected.abs().max().item()
    if difference > tolerance:
        raise EaglekitError(f"{what}: logits differ by {difference:.3g} on the probe input (tolerance {tolerance:.3g})")
    return difference
