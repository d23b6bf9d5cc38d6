"""Speculative decode methods and the drafter types that run them.

Every speculative method keeps one step contract inside `engine.decode_loop`: the drafter backend's
`extend(aux (T, n_aux*H_t), next_ids (T,), positions (T,)) -> (hidden (T, H), logits (T, Vd))` takes the accepted
positions, then `grow(drafter_backend, drafter, root_hidden (H,), root_logits (Vd,), root_token (), start,
options, vocab_size, generator) -> (DraftTree, ancestors (N, N) bool)` drafts what one target forward verifies.

- chain, tree: EAGLE-3, one drafter forward per draft level (`engine.grow_tree`).
- parallel: P-EAGLE, the whole chain in one drafter forward (`eaglekit.decode.parallel`).
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
    static: bool  # the static drafter backend (`static.StaticDrafter`) and the fused step (`fused.py`) run it


def speculative_method(name: str) -> SpeculativeMethod:
    """The grow function and eager backend of speculative method `name`."""
    from eaglekit.decode.backends import EagerDrafter

    if name in ("chain", "tree"):
        from eaglekit.decode.engine import grow_tree

        return SpeculativeMethod(name, grow_tree, EagerDrafter, static=True)
    if name == "parallel":
        from eaglekit.decode.parallel import grow_parallel

        return SpeculativeMethod(name, grow_parallel, EagerDrafter, static=True)
    if name == "dflash":
        from eaglekit.decode.dflash import DFlashDrafterBackend, grow_dflash

        return SpeculativeMethod(name, grow_dflash, DFlashDrafterBackend, static=False)
    raise EaglekitError(f"method={name} is not a speculative method this eaglekit decodes")


def check_method(method: str, drafter: Any) -> None:
    """Refuse a method the drafter's type cannot draft for, naming the ones it can."""
    kind = str(getattr(drafter.config, "drafter_type", "eagle3"))
    allowed = METHODS_OF_TYPE.get(kind, ())
    if method not in allowed:
        raise EaglekitError(f"method={method} needs a drafter of type "
                            f"{' or '.join(t for t, ms in METHODS_OF_TYPE.items() if method in ms) or 'none'}; this "
                            f"drafter is {kind}: use method={' or '.join(allowed) or 'plain'}")
