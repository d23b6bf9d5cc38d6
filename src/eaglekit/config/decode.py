"""The options of one speculative decode: one frozen dataclass, the single source of their defaults.

`eaglekit.decode` (the decoder), and the `generate`, `bench` and `serve` stages read it. A module of its own,
outside the torch-importing `eaglekit.decode` package, so that those stages' `--help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglekit import registry
from eaglekit.errors import EaglekitError

METHODS = ("plain", *registry.method_names())  # plain, and every drafter type's methods
# methods that draft a chain of `chain_length` tokens (EAGLE-3 one forward per token, P-EAGLE's and DFlash's all of
# them in one drafter forward); the others grow a tree
CHAIN_METHODS = registry.chain_method_names()
DRAFT_TOPK = ("method=dspark: add the Markov bias to each position's K best base logits alone (vLLM's "
              "dspark_draft_topk; cheaper drafting, drafts among those K, lossless); 0 = every draft id")
VERIFY_THRESHOLD = ("a drafter with a confidence head (dspark): verify only the leading drafts whose calibrated "
                    "survival (the product of their confidences) is at least this; 0 = every draft. Lossless")


@dataclass(frozen=True)
class DecodeOptions:
    method: str = "tree"  # plain, or a drafter type's method (METHODS)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # sampling filter on the target (and chain drafts); 0 = off
    top_p: float = 1.0
    depth: int = 6  # tree: draft levels
    tree_top_k: int = 8  # tree: children per expanded node, and nodes expanded per level
    total_tokens: int = 48  # tree: draft nodes verified per step (root excluded)
    chain_length: int = 4  # chain, parallel, dflash: drafts per step
    verify_threshold: float = 0.0  # a drafter with a confidence head: verify only the drafts whose calibrated survival
    # (the product of their confidences) is at least this; 0 = every draft
    draft_topk: int = 0  # dspark: the Markov bias on each position's K best base logits alone; 0 = every draft id
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise EaglekitError(f"unknown decode method '{self.method}'; use one of {', '.join(METHODS)}")
        if min(self.depth, self.tree_top_k, self.total_tokens, self.chain_length) < 1:
            raise EaglekitError("depth, tree_top_k, total_tokens and chain_length must all be >= 1")
        if not 0.0 <= self.verify_threshold <= 1.0:
            raise EaglekitError(f"verify_threshold={self.verify_threshold}: a survival probability, in [0, 1] "
                                "(0 = verify every draft)")
        if self.draft_topk < 0:
            raise EaglekitError(f"draft_topk={self.draft_topk}: the number of Markov candidates per draft, >= 1 "
                                "(0 = every draft id)")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise EaglekitError(f"temperature must be >= 0 (0 = greedy), top_k >= 0 (0 = off) and top_p in (0, 1], "
                                f"not {self.temperature}, {self.top_k} and {self.top_p}")

    @property
    def draft_depth(self) -> int:
        return self.chain_length if self.method in CHAIN_METHODS else self.depth
