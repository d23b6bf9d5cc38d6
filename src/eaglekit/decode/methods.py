"""Speculative decode methods and the drafter types that run them.

Every speculative method keeps one step contract inside `engine.decode_loop`: the drafter backend's
`extend(aux (T, n_aux*H_t), next_ids (T,), positions (T,)) -> (hidden (T, H), logits (T, Vd))` takes the accepted
positions, then `grow(drafter_backend, drafter, root_hidden (H,), root_logits (Vd,), root_token (), start,
options, vocab_size, generator) -> (DraftTree, ancestors (N, N) bool)` drafts what one target forward verifies.

- chain, tree: EAGLE-3, one drafter forward per draft level (`engine.grow_tree`).
- parallel: P-EAGLE, the whole chain in one drafter forward (`eaglekit.decode.parallel`).
- dflash: DFlash, the whole chain from one non-causal block forward (`eaglekit.decode.dflash`).

Each method names its static drafter backend (`static_backend(drafter, capacity, num_drafts, compile)`), which
`fused.FusedStep` runs as one step function on the static fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from eaglekit.errors import EaglekitError

# drafter_type -> the speculative methods it can draft for (a P-EAGLE drafter is also an EAGLE-3 drafter)
METHODS_OF_TYPE = {"eagle3": ("chain", "tree"), "p-eagle": ("parallel", "chain", "tree"), "dflash": ("dflash",)}


@dataclass(frozen=True)
class SpeculativeMethod:
    name: str
    grow: Callable[..., Any]  # see the module docstring
    eager_backend: Callable[[Any], Any]  # drafter -> the eager reference drafter backend
    static_backend: Callable[..., Any]  # (drafter, capacity, num_drafts, compile) -> the static drafter backend
    static_drafters: tuple[type, ...]  # the drafter classes the static backend covers


def _eagle_static(drafter, capacity: int, draft_slots: int, compile: bool):
    from eaglekit.decode.static import StaticDrafter

    return StaticDrafter(drafter, capacity, draft_slots, compile=compile)


def speculative_method(name: str) -> SpeculativeMethod:
    """The grow function and drafter backends of speculative method `name`."""
    from eaglekit.decode.backends import EagerDrafter
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    if name in ("chain", "tree"):
        from eaglekit.decode.engine import grow_tree

        return SpeculativeMethod(name, grow_tree, EagerDrafter, _eagle_static, (Eagle3Drafter,))
    if name == "parallel":
        from eaglekit.decode.parallel import grow_parallel

        return SpeculativeMethod(name, grow_parallel, EagerDrafter, _eagle_static, (Eagle3Drafter,))
    if name == "dflash":
        from eaglekit.decode.dflash import DFlashDrafterBackend, grow_dflash
        from eaglekit.decode.dflash_static import StaticDFlashDrafter
        from eaglekit.drafters.dflash.model import DFlashDrafter

        return SpeculativeMethod(name, grow_dflash, DFlashDrafterBackend, StaticDFlashDrafter, (DFlashDrafter,))
    raise EaglekitError(f"method={name} is not a speculative method this eaglekit decodes")


def check_method(method: str, drafter: Any) -> None:
    """Refuse a method the drafter's type cannot draft for, naming the ones it can."""
    kind = str(getattr(drafter.config, "drafter_type", "eagle3"))
    allowed = METHODS_OF_TYPE.get(kind, ())
    if method not in allowed:
        raise EaglekitError(f"method={method} needs a drafter of type "
                            f"{' or '.join(t for t, ms in METHODS_OF_TYPE.items() if method in ms) or 'none'}; this "
                            f"drafter is {kind}: use method={' or '.join(allowed) or 'plain'}")
