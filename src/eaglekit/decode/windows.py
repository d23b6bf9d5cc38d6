"""Which keys each decoder layer of a target attends to, and the masks that say so: full causal attention, or a
sliding window (Mistral, Qwen2/3 with `sliding_window`, Gemma-2/3, any config whose `layer_types` mixes
"full_attention" and "sliding_attention" layers).

Transformers' rule (`masking_utils.sliding_window_overlay`): with window W, the token at position p sees the keys
at positions p - W < q <= p (W keys, itself included). Decoding applies it to positions, not to cache slots, so a
draft-tree node at depth d (position m + d) sees what the token at that position sees in plain decoding: its
ancestors, and the prefix from position m + d - W + 1 on. Both backends keep every key of a sliding layer (the
cache is as long as the sequence) and mask the ones outside the window, so compacting the cache to the accepted
path works as it does for full attention.

Layers whose state cannot be cut back to the accepted path, or whose mask eaglekit does not build (chunked
attention, linear-attention or SSM states, sparse indexed attention, ...), are refused for speculative decoding
before any work (`check_speculative`); plain decoding runs them on the model's own cache and masks.
"""

from __future__ import annotations

from typing import Any

import torch

from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import text_config

FULL, SLIDING = "full_attention", "sliding_attention"
# models whose attention reads `config.sliding_window` in every layer, whatever `layer_types` says
UNIFORM_WINDOW_MODELS = ("mistral",)


def _window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not window:
        return None
    return int(window)


def layer_kinds(config: Any) -> tuple[str, ...]:
    """Per decoder layer of a (possibly multimodal) target config: its attention kind, as `layer_types` names it
    ("full_attention", "sliding_attention", "chunked_attention", ...); configs without `layer_types` give every
    layer the same kind (sliding where `sliding_window` is set)."""
    config = text_config(config)
    layers = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds and config.model_type not in UNIFORM_WINDOW_MODELS:
        return tuple(str(kind) for kind in kinds)
    if getattr(config, "attention_chunk_size", None):
        return ("chunked_attention",) * layers
    return (SLIDING if _window(config) else FULL,) * layers


def unsupported_kinds(config: Any) -> list[str]:
    """Layer kinds of `config` that speculative decoding cannot run (empty: every layer is full or sliding)."""
    return sorted(set(layer_kinds(config)) - {FULL, SLIDING})


def config_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer: its sliding window W, or None for full attention (layers of other kinds: None; see
    `unsupported_kinds`)."""
    window = _window(text_config(config))
    return tuple(window if kind == SLIDING else None for kind in layer_kinds(config))


def model_windows(model: torch.nn.Module, layers: list[torch.nn.Module]) -> tuple[int | None, ...]:
    """`config_windows` of a loaded model, where a layer's attention module holding its own `sliding_window`
    (what the modelling code reads: Qwen2/3, Gemma-2/3, ...) has the last word."""
    windows = list(config_windows(model.config))
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "sliding_window"):
            windows[i] = int(attention.sliding_window) if attention.sliding_window else None
    return tuple(windows)


def check_speculative(config: Any, name: str = "the target") -> None:
    """Refuse, with the reason, a target whose layers speculative decoding cannot run exactly."""
    kinds = unsupported_kinds(config)
    if kinds:
        raise EaglekitError(f"{name} has {', '.join(kinds)} layers: speculative decoding keeps only the accepted "
                            "tokens' keys and values, which eaglekit does for full and sliding-window attention "
                            "only; decode it with method=plain")


def window_mask(
    mask: torch.Tensor,  # (..., T, S) bool, True = attend
    query_positions: torch.Tensor,  # (T,) position of each query
    key_positions: torch.Tensor,  # (S,) position of the token in each key column
    window: int,
) -> torch.Tensor:
    """`mask` limited to the keys inside each query's sliding window: q - W < k <= q (transformers' rule)."""
    return mask & (key_positions[None, :] > query_positions[:, None] - window)  # (..., T, S)
