"""The eager reference target backend: any Hugging Face causal LM (each drafter type's eager drafter backend lives
in its folder). The fast static-cache backend in `eaglekit.decode.static` has the same methods.

Target backend:  forward(ids (T,), positions (T,), mask (T, T) bool over the new tokens) ->
                 (logits (T, V), aux (T, 3H) or None); keep(nodes (K,) long) compacts the cache so that of
                 the last forward only those tokens remain, in that order.

Tree verification in one HF forward: transformers 5 returns a 4D `attention_mask` unchanged
(`masking_utils._preprocess_mask_arguments`), so we pass a float mask (0 = attend, dtype min = not)
of shape (1, 1, T, past + T), which SDPA and eager attention both add to the scores. Sliding-window layers
(`windows.py`) get that mask limited to their window: one mask when every layer has the same window, else a dict
by layer kind ("full_attention", "sliding_attention"), which the models that mix them take as it is; their cache
keeps every key. A target with layers of another kind (chunked, linear attention, ...) decodes plain only, on
its own cache and masks.
"""

from __future__ import annotations

import inspect

import torch

from eaglekit.decode.windows import (
    FULL, SLIDING, check_speculative, model_windows, unsupported_kinds, window_mask,
)
from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import HiddenStateCapture, find_decoder


def make_hf_cache(model: torch.nn.Module | None):
    """A fresh `DynamicCache` for `model` (config-aware where this transformers version allows); for None, one
    whose every layer keeps all its keys."""
    from transformers import DynamicCache

    if model is None:
        return DynamicCache()
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def compact_hf_cache(cache, keep: torch.Tensor) -> None:
    """Keep only sequence positions `keep` (S',) of every layer of an HF cache, in place."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if getattr(layer, "is_sliding", False):
                raise EaglekitError("sliding-window cache layers cannot be compacted yet; decode with method=plain")
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        return
    for i in range(len(cache.key_cache)):  # older cache layout
        cache.key_cache[i] = cache.key_cache[i].index_select(-2, keep)
        cache.value_cache[i] = cache.value_cache[i].index_select(-2, keep)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, S) bool (True = attend) -> (1, 1, T, S) float: 0 where attended, dtype min elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, torch.finfo(dtype).min)[None, None]


class HFTarget:
    """Reference target backend: the loaded HF model, its DynamicCache, aux states by hooks."""

    def __init__(self, model: torch.nn.Module, aux_layers: tuple[int, ...] | None):
        self.model = model
        self.aux_layers = aux_layers
        # the model's own masks and cache (plain decoding only) where some layer is neither full nor sliding
        self.native = bool(unsupported_kinds(model.config))
        if self.native and aux_layers is not None:  # aux states are asked for speculative decoding only
            check_speculative(model.config, getattr(model.config, "_name_or_path", "") or "the target")
        windows = () if self.native else model_windows(model, find_decoder(model).layers)
        sliding = {w for w in windows if w is not None}
        if len(sliding) > 1:
            raise EaglekitError(f"layers with different sliding windows {sorted(sliding)}: transformers builds one "
                                "sliding mask per model; decode it with method=plain")
        self.window = sliding.pop() if sliding else None
        self.mixed = self.window is not None and None in windows  # full and sliding layers: a mask per kind
        # a sliding layer's cache keeps every key here (the window is in the mask), so it compacts like a full one
        self.cache = make_hf_cache(model) if self.window is None else make_hf_cache(None)
        self.length = 0  # tokens in the cache
        self.last_length = 0  # tokens the last forward added
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # transformers >= 5.2x names the cache kwarg `cache`; earlier 5.x `past_key_values`
        parameters = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self.keeps_logits = "logits_to_keep" in parameters  # custom (remote) code may not take it: then sliced after

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, last_only: bool = False):
        """-> logits (T, V) of the new tokens (with `last_only`, (1, V): the last one's), aux states (T, 3H) or None."""
        kwargs = dict(input_ids=ids[None], position_ids=positions[None], attention_mask=self._mask(positions, mask),
                      use_cache=True, **{self.cache_kwarg: self.cache})
        if last_only and self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        if self.aux_layers is None:
            logits, aux = self.model(**kwargs).logits[0], None
        else:
            with HiddenStateCapture(self.model, self.aux_layers, capture_final=False) as capture:
                logits = self.model(**kwargs).logits[0]
                aux = capture.aux()[0]  # (T, 3H)
        self.length += ids.shape[0]
        self.last_length = ids.shape[0]
        return (logits[-1:] if last_only else logits), aux

    def _mask(self, positions: torch.Tensor, mask: torch.Tensor):
        """The attention mask of new tokens at `positions` (T,) that see each other by `mask` (T, T): (1, 1, T, S+T)
        additive over the cache and them, a dict of such by layer kind, or None (the model's own causal masks)."""
        if self.native:
            assert bool(mask.tril().eq(mask).all()) and bool(mask.diagonal().all()), "native masks are causal only"
            return None
        prefix = torch.ones(mask.shape[0], self.length, dtype=torch.bool, device=mask.device)
        full = torch.cat([prefix, mask], dim=1)  # (T, S+T)
        if self.window is None:
            return additive_mask(full, self.dtype)
        keys = torch.cat([torch.arange(self.length, device=mask.device), positions])  # cache slot i holds position i
        sliding = additive_mask(window_mask(full, positions, keys, self.window), self.dtype)
        return {FULL: additive_mask(full, self.dtype), SLIDING: sliding} if self.mixed else sliding

    def keep(self, nodes: torch.Tensor) -> None:
        if self.native:
            raise EaglekitError("this target decodes with method=plain only (see `eaglekit.decode.windows`)")
        base = self.length - self.last_length
        keep = torch.cat([torch.arange(base, device=self.device), base + nodes])
        compact_hf_cache(self.cache, keep)
        self.length = base + nodes.shape[0]
        self.last_length = nodes.shape[0]


