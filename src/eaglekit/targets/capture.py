"""Auxiliary hidden-state capture from any Hugging Face model class, by forward hooks.

The decoder layer stack is found on the model object that is really loaded (a `*ForCausalLM`, or a
multimodal wrapper whose decoder sits deeper, e.g. `model.language_model.layers`), never by forking
a modelling file. Hooks count their calls so that a caller can verify they fired.

Layer ids use `INPUT_OF_LAYER` (the vLLM/EAGLE convention): id i is the hidden state ENTERING decoder layer i
(`eaglekit.layers` holds the conventions, their conversions and the default layers).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eaglekit.errors import EaglekitError
from eaglekit.layers import (  # noqa: F401  the conventions and default layers, re-exported for capture's callers
    INPUT_OF_LAYER,
    OUTPUT_OF_LAYER,
    default_aux_layers,
    engine_aux_layers,
    from_input_convention,
    to_input_convention,
)

log = logging.getLogger(__name__)

# Fallback table of known decoder-stack paths, tried after the generic search.
KNOWN_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.model.layers",
    "model.model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.text_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
)
# the final norm that feeds the lm_head, by the names models give it (LFM2 calls its final norm embedding_norm)
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "embedding_norm")
_NON_TEXT = ("vision", "visual", "audio", "image", "vit", "encoder", "mm_projector", "multi_modal")


@dataclass
class DecoderStack:
    """Where a model's text decoder lives."""

    path: str  # dotted path of the layer ModuleList, e.g. "model.language_model.layers"
    layers: nn.ModuleList
    norm_path: str | None  # dotted path of the final norm that feeds the lm_head
    norm: nn.Module | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) HF config."""
    for name in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, name, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return config


def _get(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


_LAYER_SUFFIXES = ("layer", "block", "decoderlayer")
_NOT_LAYERS = ("expert", "mlp", "embedding")


def _looks_like_layers(module: nn.ModuleList) -> bool:
    """Same-class blocks, or blocks whose classes all read as layers (hybrid stacks: attention + mamba)."""
    names = {type(m).__name__.lower() for m in module}
    if any(token in name for name in names for token in _NOT_LAYERS):
        return False
    if isinstance(module[0], (nn.Linear, nn.ModuleList, nn.Embedding)):
        return False
    return len(names) == 1 or all(name.endswith(_LAYER_SUFFIXES) for name in names)


def _final_norm(model: nn.Module, parent_path: str) -> tuple[str | None, nn.Module | None]:
    parent = _get(model, parent_path) if parent_path else model
    for name in FINAL_NORM_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module):
            return f"{parent_path}.{name}".lstrip("."), module
    return None, None


def _parent_path(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _candidate_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of decoder-like blocks that are not vision/audio towers or MoE expert lists."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(token in name.lower() for token in _NON_TEXT) or name.lower().endswith("experts"):
            continue
        if _looks_like_layers(module):
            found.append((name, module))
    return found


def _rank(model: nn.Module, expected: int | None, path: str, layers: nn.ModuleList) -> tuple:
    """Sort key, best first: right layer count, a final norm beside it, many layers, shallow path."""
    has_norm = _final_norm(model, _parent_path(path))[1] is not None
    return (expected is not None and len(layers) == expected, has_norm, len(layers), -path.count("."))


def describe_stacks(model: nn.Module) -> str:
    """What the search found, for error messages: 'path (N x Class)' for every layer-like ModuleList."""
    rows = [f"{name} ({len(m)} x {type(m[0]).__name__})" for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) > 0]
    return "; ".join(rows[:12]) or "no ModuleList at all"


def find_decoder(model: nn.Module, path: str | None = None) -> DecoderStack:
    """Locate the text decoder's layer stack and final norm on the model object actually loaded.

    `path` (dotted, e.g. "model.language_model.layers") overrides the search; it is still verified.
    """
    expected = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    if path:
        layers = _get(model, path)
        if not isinstance(layers, nn.ModuleList):
            raise EaglekitError(
                f"decoder_path '{path}' is not a ModuleList in {type(model).__name__}; found: {describe_stacks(model)}"
            )
        candidates = [(path, layers)]
    else:
        candidates = _candidate_stacks(model)
        candidates += [(p, _get(model, p)) for p in KNOWN_LAYER_PATHS
                       if isinstance(_get(model, p), nn.ModuleList) and p not in dict(candidates)]
        candidates.sort(key=lambda item: _rank(model, expected, *item), reverse=True)
    if not candidates:
        raise EaglekitError(
            f"no decoder layer stack found in {type(model).__name__} (expected {expected} layers); searched every "
            f"ModuleList and the known paths {', '.join(KNOWN_LAYER_PATHS)}; found: {describe_stacks(model)}. "
            "Pass decoder_path=<dotted path of the layer list> or report print(model) to eaglekit."
        )
    path, layers = candidates[0]
    norm_path, norm = _final_norm(model, _parent_path(path))
    return DecoderStack(path=path, layers=layers, norm_path=norm_path, norm=norm)


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


class HiddenStateCapture:
    """Context manager: hooks that record the aux states (input convention) and the final-norm output.

    with HiddenStateCapture(model, (2, 16, 29)) as capture:
        model(input_ids)
        aux = capture.aux()      # (B, T, 3*H), low/mid/high concatenated
        final = capture.final()  # (B, T, H), what the lm_head reads
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layers: tuple[int, ...],
        capture_final: bool = True,
        *,
        convention: str = INPUT_OF_LAYER,
        decoder_path: str | None = None,
    ):
        self.model = model
        self.stack = find_decoder(model, decoder_path)
        num_layers = self.stack.num_layers
        aux_layers = to_input_convention(tuple(aux_layers), convention)
        for layer_id in aux_layers:
            if not 0 <= layer_id <= num_layers:
                raise EaglekitError(
                    f"aux layer id {layer_id} ({INPUT_OF_LAYER} convention) is out of range for a target with "
                    f"{num_layers} layers (valid: 0..{num_layers}); omit aux_layer_ids for the default "
                    f"{default_aux_layers(num_layers) if num_layers >= 3 else '(none)'}"
                )
        if capture_final and self.stack.norm is None:
            raise EaglekitError(
                f"no final norm ({', '.join(FINAL_NORM_NAMES)}) found next to {self.stack.path} in "
                f"{type(model).__name__}: if {self.stack.path} is not the text decoder's layer list, pass "
                "decoder_path= to point at it; if it is, the model names its final norm otherwise (capture knows "
                "these names only)"
            )
        self.aux_layers = tuple(aux_layers)  # always in the input-of-layer convention
        self.capture_final = capture_final
        self.states: dict[int, torch.Tensor] = {}
        self.final_state: torch.Tensor | None = None
        self.calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def _pre_hook(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.states[layer_id] = hidden
            self.calls[f"aux{layer_id}"] = self.calls.get(f"aux{layer_id}", 0) + 1
        return hook

    def _post_hook(self, key: str, layer_id: int | None):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            hidden = _first_tensor(output)
            if layer_id is None:
                self.final_state = hidden
            else:
                self.states[layer_id] = hidden
            self.calls[key] = self.calls.get(key, 0) + 1
        return hook

    def __enter__(self) -> HiddenStateCapture:
        layers = self.stack.layers
        for layer_id in sorted(set(self.aux_layers)):  # one hook per distinct id (L=4 defaults repeat none, L=5 may)
            if layer_id < len(layers):
                handle = layers[layer_id].register_forward_pre_hook(self._pre_hook(layer_id), with_kwargs=True)
            else:  # id L: the last layer's output, before the final norm
                handle = layers[-1].register_forward_hook(self._post_hook(f"aux{layer_id}", layer_id))
            self._handles.append(handle)
        if self.capture_final:
            self._handles.append(self.stack.norm.register_forward_hook(self._post_hook("final", None)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.states.clear()
        self.final_state = None
        self.calls.clear()

    def aux(self) -> torch.Tensor:
        """(B, T, 3*H): the captured states in `aux_layers` order, concatenated on the last dim."""
        missing = [i for i in self.aux_layers if i not in self.states]
        if missing:
            raise EaglekitError(
                f"hooks for aux layers {missing} did not fire on {type(self.model).__name__} (decoder at "
                f"{self.stack.path}); the class that ran is not the one whose layers were hooked"
            )
        first = self.states[self.aux_layers[0]]
        # with device_map="auto" the layers (and their states) may sit on different GPUs
        return torch.cat([self.states[i].to(first.device) for i in self.aux_layers], dim=-1)

    def final(self) -> torch.Tensor:
        """(B, T, H): the final-norm output that the lm_head reads."""
        if self.final_state is None:
            raise EaglekitError(f"the final-norm hook ({self.stack.norm_path}) did not fire on "
                                f"{type(self.model).__name__}")
        return self.final_state


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_target(
    model: nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None = None,  # (B, T), 1 = real token
    output_hidden_states: bool = False,
) -> Any:
    """One target forward for capture: no KV cache, and logits only for the last position when the class
    allows it (the lm_head over a 100k+ vocabulary is otherwise the largest tensor of the pass)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    return model(**kwargs)
