"""The contract between the decode loop and a drafter type's drafting: one `SpeculativeMethod` per decode method.

Every speculative method keeps one step contract inside `engine.decode_loop`: the drafter backend's
`extend(aux (T, n_aux*H_t), next_ids (T,), positions (T,)) -> (hidden (T, H), logits (T, Vd))` takes the accepted
positions, then `grow(drafter_backend, drafter, root_hidden (H,), root_logits (Vd,), root_token (), start,
options, vocab_size, generator) -> (DraftTree, ancestors (N, N) bool)` drafts what one target forward verifies.

The methods live with the drafter types that define them (`eaglekit.registry`): chain and tree (EAGLE-3, one drafter
forward per draft level, `eaglekit.drafters.eagle3.decode`), parallel (P-EAGLE, the chain in one drafter forward),
dflash (one non-causal block forward). Each names its static drafter backend (`static_backend(drafter, capacity,
num_drafts, compile)`), which `fused.FusedStep` runs as one step function on the static fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class SpeculativeMethod:
    name: str
    grow: Callable[..., Any]  # see the module docstring
    eager_backend: Callable[[Any], Any]  # drafter -> the eager reference drafter backend
    static_backend: Callable[..., Any]  # (drafter, capacity, num_drafts, compile) -> the static drafter backend
    static_supported: Callable[[Any], bool]  # drafter -> True when the static backend covers it
    at_once: bool = False  # a chain whose k drafts are drawn together (`tree.chain_from_logits`), not one a level
    # the chain's drafts 2..k come with the extend's drafter forward (P-EAGLE's mask slots), one drafter forward a
    # step: (drafter backend, drafter, root_logits (Vd,), start, k) -> (k - 1, Vd), the first step's
    ahead: Callable[..., Any] | None = None
    check: Callable[[Any, Any], None] | None = None  # (drafter config, options): refuse what it cannot draft
    confidence: bool = False  # cuts its chain where the drafter's calibrated survival falls below `verify_threshold`
    markov: bool = False  # corrects each draft by the one before it, on `draft_topk` candidates when that is set
