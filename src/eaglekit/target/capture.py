"""Auxiliary hidden-state capture from any Hugging Face model class, by forward hooks.

The decoder layer stack is found on the model object that is really loaded (a `*ForCausalLM`, or a
multimodal wrapper whose decoder sits deeper, e.g. `model.language_model.layers`), never by forking
a modelling file. Hooks count their calls so that a caller can verify they fired.

Layer-id convention (`INPUT_OF_LAYER`, the vLLM/EAGLE one): id i is the hidden state ENTERING
decoder layer i; id 0 is the embedding output and id L (L = number of layers) is the last layer's
output before the final norm. SGLang's explicit ids mean "output of layer k" = our id k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eaglekit.draft.model import INPUT_OF_LAYER, OUTPUT_OF_LAYER
from eaglekit.errors import EaglekitError

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
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")
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


def _candidate_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of same-class blocks that are not vision/audio towers, largest first."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(token in name.lower() for token in _NON_TEXT):
            continue
        if len({type(m) for m in module}) == 1 and not isinstance(module[0], (nn.Linear, nn.ModuleList)):
            found.append((name, module))
    return sorted(found, key=lambda item: -len(item[1]))


def find_decoder(model: nn.Module) -> DecoderStack:
    """Locate the text decoder's layer stack and final norm on the model object actually loaded."""
    expected = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    candidates = [(n, m) for n, m in _candidate_stacks(model) if expected is None or len(m) == expected]
    if not candidates:
        candidates = [(p, _get(model, p)) for p in KNOWN_LAYER_PATHS if isinstance(_get(model, p), nn.ModuleList)]
    if not candidates:
        searched = ", ".join(KNOWN_LAYER_PATHS)
        raise EaglekitError(
            f"no decoder layer stack found in {type(model).__name__} (expected {expected} layers); searched every "
            f"ModuleList and the known paths {searched}. Report the model's module tree (print(model)) to eaglekit."
        )
    path, layers = candidates[0]
    parent_path = path.rsplit(".", 1)[0] if "." in path else ""
    parent = _get(model, parent_path) if parent_path else model
    norm_path, norm = None, None
    for name in FINAL_NORM_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module):
            norm_path, norm = f"{parent_path}.{name}".lstrip("."), module
            break
    return DecoderStack(path=path, layers=layers, norm_path=norm_path, norm=norm)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 default: the states entering layers 2, L//2 and L-3 (input-of-layer convention)."""
    if num_layers < 4:
        raise EaglekitError(f"EAGLE-3 needs a target with at least 4 decoder layers, this one has {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


def to_input_convention(layer_ids: tuple[int, ...], convention: str) -> tuple[int, ...]:
    """Convert explicit ids to the input-of-layer convention."""
    if convention == INPUT_OF_LAYER:
        return tuple(layer_ids)
    if convention == OUTPUT_OF_LAYER:
        return tuple(i + 1 for i in layer_ids)
    raise EaglekitError(f"unknown layer-id convention '{convention}'; use '{INPUT_OF_LAYER}' or '{OUTPUT_OF_LAYER}'")


def from_input_convention(layer_ids: tuple[int, ...], convention: str) -> tuple[int, ...]:
    """Convert input-of-layer ids to `convention`."""
    if convention == INPUT_OF_LAYER:
        return tuple(layer_ids)
    if convention == OUTPUT_OF_LAYER:
        return tuple(i - 1 for i in layer_ids)
    raise EaglekitError(f"unknown layer-id convention '{convention}'; use '{INPUT_OF_LAYER}' or '{OUTPUT_OF_LAYER}'")


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


class HiddenStateCapture:
    """Context manager: hooks that record the aux states (input convention) and the final-norm output.

    with HiddenStateCapture(model, (2, 16, 29)) as capture:
        model(input_ids)
        aux = capture.aux()      # (B, T, 3*H), low/mid/high concatenated
        final = capture.final()  # (B, T, H), what the lm_head reads
    """

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...], capture_final: bool = True):
        self.model = model
        self.stack = find_decoder(model)
        num_layers = self.stack.num_layers
        for layer_id in aux_layers:
            if not 0 <= layer_id <= num_layers:
                raise EaglekitError(f"aux layer id {layer_id} is out of range for a target with {num_layers} layers (valid: 0..{num_layers})")
        if capture_final and self.stack.norm is None:
            raise EaglekitError(f"no final norm found next to {self.stack.path} in {type(model).__name__}")
        self.aux_layers = tuple(aux_layers)
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
        for layer_id in self.aux_layers:
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
                f"hooks for aux layers {missing} did not fire on {type(self.model).__name__} (decoder at {self.stack.path}); "
                "the class that ran is not the one whose layers were hooked"
            )
        return torch.cat([self.states[i] for i in self.aux_layers], dim=-1)

    def final(self) -> torch.Tensor:
        """(B, T, H): the final-norm output that the lm_head reads."""
        if self.final_state is None:
            raise EaglekitError(f"the final-norm hook ({self.stack.norm_path}) did not fire on {type(self.model).__name__}")
        return self.final_state
