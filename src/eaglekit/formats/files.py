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
    """All tensors of a checkpoint dir: model.safetensors, a sharded index, or pytorch_model.bin, each in storage of
    its own. (`safetensors.load_file` gives views of one buffer at the file's offsets, which need not be 64-byte
    aligned; a CPU matmul then takes another kernel path and differs from the same weights elsewhere in the last
    bit, and a round trip compares fp32 logits exactly.)"""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    binary = directory / "pytorch_model.bin"
    if single.is_file():
        state = load_file(str(single))
    elif index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(directory / shard)))
    elif binary.is_file():
        state = torch.load(str(binary), map_location="cpu", weights_only=True)
    else:
        raise EaglekitError(f"{directory} has no model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")
    return {name: tensor.clone() for name, tensor in state.items()}


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
