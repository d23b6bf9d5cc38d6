"""Layer-id conventions for the target's aux hidden states, and the default layers a drafter fuses.

`INPUT_OF_LAYER` (vLLM / EAGLE, eaglekit's own): id i is the hidden state ENTERING decoder layer i; id 0 is the
embedding output and id L (L = number of layers) is the last layer's output before the final norm.
`OUTPUT_OF_LAYER` (SGLang's explicit ids): id k is the output of decoder layer k, i.e. input-of-layer id k + 1.

A neutral module below `eaglekit.targets` (capture) and `eaglekit.drafters.eagle3` (the drafter's config), both of which
use it.
"""

from __future__ import annotations

import logging

from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

INPUT_OF_LAYER = "input_of_layer"  # vLLM / EAGLE convention: id i = hidden state entering decoder layer i
OUTPUT_OF_LAYER = "output_of_layer"  # SGLang convention for explicit ids: id k = output of decoder layer k
CONVENTIONS = (INPUT_OF_LAYER, OUTPUT_OF_LAYER)


def engine_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """What vLLM, SGLang and the reference code pick when a checkpoint names no ids: the states entering layers
    2, L//2 and L-3 (input-of-layer). On targets under 7 layers these repeat a layer (4 layers: 2, 2, 1)."""
    return (2, num_layers // 2, num_layers - 3)


_warned_small: set[int] = set()


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The aux layers a new drafter fuses (input-of-layer): the engine default (2, L//2, L-3) when its three
    layers are distinct and in order (L >= 7), else three distinct states spread over the target (1, L//2, L-1;
    3 layers: 1, 2, 3), with one warning; explicit ids are the way to choose others."""
    if num_layers < 3:
        raise EaglekitError(f"EAGLE-3 fuses three distinct hidden states: a target with {num_layers} decoder layers "
                            "has too few (it needs at least 3)")
    ids = engine_aux_layers(num_layers)
    if ids[0] < ids[1] < ids[2]:  # low, middle, high: 7 layers and more
        return ids
    spread = (1, 2, 3) if num_layers == 3 else (1, num_layers // 2, num_layers - 1)
    if num_layers not in _warned_small:
        _warned_small.add(num_layers)
        log.warning("a %d-layer target: the usual aux layers %s repeat a layer, so the drafter fuses %s instead "
                    "(pass aux_layer_ids to choose)", num_layers, list(ids), list(spread))
    return spread


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
