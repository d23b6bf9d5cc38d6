"""Device and dtype resolution, done once at the edge of every stage (library code never calls `.cuda()`)."""

from __future__ import annotations

import torch

from eaglekit.errors import EaglekitError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as torch understands it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EaglekitError(f"device '{name}' was asked for but no CUDA GPU is visible; use device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise EaglekitError(f"unknown dtype '{name}'; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
