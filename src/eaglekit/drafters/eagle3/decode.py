"""EAGLE-3 drafting (`method=chain`, `method=tree`): one drafter forward per draft level, a chain or an EAGLE-2 dynamic
tree grown from the drafter's top-k (sampled: drawn without replacement) per node, the reference drafter backend
with a growing KV cache (`EagerDrafter`), and the methods' contract objects (`METHODS`).

Positions: the root sits at position m (the number of tokens the target has cached); a node at depth d at m + d. The
drafter step for position t reads (feature of t, token t+1), so a depth-d node is fed at drafter position m + d - 1
with its parent's output hidden state.

Drafter backend: extend(aux (T, 3H_t), next_ids (T,), positions (T,)) -> (hidden (T, H), logits (T, Vd))
                 appends target-feature positions to the stable cache and drops earlier draft slots;
                 draft_step(hidden (k, H), ids (k,), positions (k,), visible (k, E+k) bool over draft slots)
                 -> (hidden (k, H), logits (k, Vd)).
"""

from __future__ import annotations

import torch

from eaglekit.config.decode import DecodeOptions
from eaglekit.decode.methods import SpeculativeMethod
from eaglekit.decode.sampling import draft_probs_to_target, logits_to_probs, sample
from eaglekit.decode.tree import (
    DraftTree, ancestor_matrix, build_tree, expand_candidates, extend_ancestry, next_frontier, sample_candidates,
)

STATIC_DRAFTER_ARCHS = ("llama",)  # midlayers `static.StaticDraftNet` implements


class EagerDrafter:
    """Reference drafter backend: concatenated KV tensors, stable part plus this round's draft slots."""

    def __init__(self, drafter: torch.nn.Module):
        self.drafter = drafter
        self.stable: tuple[torch.Tensor, torch.Tensor] | None = None  # 2 x (1, nkv, S, D)
        self.draft: tuple[torch.Tensor, torch.Tensor] | None = None  # 2 x (1, nkv, E, D)

    @property
    def stable_length(self) -> int:
        return 0 if self.stable is None else self.stable[0].shape[2]

    def extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        from eaglekit.decode.tree import causal_mask

        feature = self.drafter.fuse(aux.to(next(self.drafter.parameters()).dtype))[None]  # (1, T, H)
        mask = causal_mask(next_ids.shape[0], self.stable_length, next_ids.device)[None, None]
        hidden, logits, (k, v) = self.drafter(feature, next_ids[None], positions[None], self.stable, mask)
        self.stable = (k, v) if self.stable is None else (torch.cat([self.stable[0], k], 2),
                                                          torch.cat([self.stable[1], v], 2))
        self.draft = None
        return hidden[0], logits[0]

    def draft_step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        past = self.stable
        if self.draft is not None:
            past = (torch.cat([self.stable[0], self.draft[0]], 2), torch.cat([self.stable[1], self.draft[1]], 2))
        prefix = torch.ones(ids.shape[0], self.stable_length, dtype=torch.bool, device=ids.device)
        mask = torch.cat([prefix, visible], dim=1)[None, None]  # (1, 1, k, S + E + k)
        out, logits, (k, v) = self.drafter(hidden[None], ids[None], positions[None], past, mask)
        self.draft = (k, v) if self.draft is None else (torch.cat([self.draft[0], k], 2),
                                                        torch.cat([self.draft[1], v], 2))
        return out[0], logits[0]


def draft(drafter_backend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor, root_token: torch.Tensor,
          start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
          generator: torch.Generator | None) -> DraftTree:
    """Grow a chain or EAGLE-2 tree from the root. root_hidden (H,), root_logits (Vd,), root_token ().

    Every shape depends on `options` alone and nothing is read back to the host, so for deterministic
    drafts (trees, greedy chains) the whole function can run as one captured graph (`static.py`)."""
    chain = options.method == "chain"
    width, depth = (1, options.chain_length) if chain else (options.tree_top_k, options.depth)
    sampled = chain and options.temperature > 0
    sampled_tree = not chain and options.temperature > 0  # children drawn without replacement from q
    device = root_logits.device
    all_draft_ids = drafter.draft_to_target(torch.arange(root_logits.shape[-1], device=device))  # (Vd,)
    f_hidden, f_logits = root_hidden[None], root_logits[None]  # (k, H), (k, Vd) of the frontier nodes
    f_scores = torch.zeros(1, device=device)
    f_pool = torch.full((1,), -1, dtype=torch.long, device=device)  # pool index, -1 = root
    f_slot = torch.full((1,), -1, dtype=torch.long, device=device)  # drafter draft slot, -1 = root
    ancestry = torch.zeros(0, 0, dtype=torch.bool, device=device)
    pool: dict[str, list[torch.Tensor]] = {"tokens": [], "scores": [], "parents": [], "depths": [], "q": [],
                                           "owner": []}
    offset = 0
    for level in range(1, depth + 1):
        if sampled or sampled_tree:
            q = logits_to_probs(f_logits, options.temperature, options.top_k, options.top_p)  # (frontier, Vd)
            if sampled:
                ids, scores, slots = sample(q, generator), f_scores, torch.zeros(1, dtype=torch.long, device=device)
            else:
                ids, scores, slots = sample_candidates(f_scores, q, width, generator)
                pool["owner"].append(f_pool)
            pool["q"].append(draft_probs_to_target(q, all_draft_ids, vocab_size))
        else:
            ids, scores, slots = expand_candidates(f_scores, f_logits, width)
        tokens = all_draft_ids[ids]
        pool["tokens"].append(tokens)
        pool["scores"].append(scores)
        pool["parents"].append(f_pool[slots])
        pool["depths"].append(torch.full_like(tokens, level))
        if level == depth:
            break
        pick = next_frontier(scores, width)  # (k,) candidates to feed to the drafter
        parent = slots[pick]
        ancestry = extend_ancestry(ancestry, f_slot[parent])
        used = ancestry.shape[0] - pick.shape[0]
        positions = torch.zeros_like(pick) + (start + level - 1)  # `start` may be a 0-d tensor (compiled graph)
        f_hidden, f_logits = drafter_backend.draft_step(f_hidden[parent], tokens[pick], positions, ancestry[used:])
        f_scores, f_pool = scores[pick], offset + pick
        f_slot = used + torch.arange(pick.shape[0], device=device)
        offset += tokens.shape[0]
    cat = {k: torch.cat(v) for k, v in pool.items() if v}
    tree = build_tree(root_token, cat["tokens"], cat["scores"], cat["parents"], cat["depths"],
                      min(options.total_tokens if not chain else depth, cat["tokens"].shape[0]),
                      *((cat["q"], cat["owner"]) if sampled_tree else ()))
    if sampled:
        tree.draft_probs = torch.cat([torch.zeros_like(cat["q"][:1]), cat["q"]])  # chain keeps every node
    return tree


def grow_tree(drafter_backend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor, root_token: torch.Tensor,
              start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
              generator: torch.Generator | None) -> tuple[DraftTree, torch.Tensor]:
    """`draft` plus the tree's (N, N) ancestors-or-self matrix, which is the verify attention mask."""
    tree = draft(drafter_backend, drafter, root_hidden, root_logits, root_token, start, options, vocab_size, generator)
    return tree, ancestor_matrix(tree.parents, options.draft_depth)



def static_supported(drafter: torch.nn.Module) -> bool:
    """True when the static drafter step covers `drafter`: an `Eagle3Drafter` with a Llama-style midlayer (any other
    object that keeps the drafter contract runs the eager reference drafter, also under backend=static)."""
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    return isinstance(drafter, Eagle3Drafter) and drafter.config.drafter_arch in STATIC_DRAFTER_ARCHS


def static_backend(drafter: torch.nn.Module, capacity: int, draft_slots: int, compile: bool):
    from eaglekit.drafters.eagle3.static import StaticDrafter

    return StaticDrafter(drafter, capacity, draft_slots, compile=compile)


METHODS = {name: SpeculativeMethod(name, grow_tree, EagerDrafter, static_backend, static_supported)
           for name in ("chain", "tree")}
