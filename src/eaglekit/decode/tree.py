"""Draft trees: EAGLE-2 dynamic tree growth, node selection, ancestry and the tree attention mask.

Pure tensor functions, no model calls; the decode loop in `eaglekit.decode.engine` feeds them the
drafter's logits. A tree is stored flat, parents before children:

    tokens  (N,) target-vocab ids; node 0 is the root (the last token the target produced)
    parents (N,) index of each node's parent, -1 for the root
    depths  (N,) 0 for the root; a node at depth d sits at sequence position start + d

A chain of k drafts is the tree with parents [-1, 0, 1, ..., k-1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglekit.decode.sampling import PreDrawn, draft_probs_to_target, logits_to_probs, rand, sample


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) long, target vocabulary, root first
    parents: torch.Tensor  # (N,) long, -1 for the root
    depths: torch.Tensor  # (N,) long
    # (N, V) distribution node i was drawn from (sampled chains); None = deterministic
    draft_probs: torch.Tensor | None = None
    child_probs: torch.Tensor | None = None  # (N, V) distribution node i's children were drawn from (sampled trees)
    # () drafts verified: a chain cut where the drafter's calibrated survival falls below `verify_threshold`; None = all
    limit: torch.Tensor | None = None
    survival: torch.Tensor | None = None  # (N - 1,) the calibrated survival of each draft's prefix (a confidence head)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def chain_parents(num_drafts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(k+1,) parents of a root followed by a chain of k drafts."""
    return torch.arange(-1, num_drafts, device=device)


def chain_from_logits(drafter, logits: torch.Tensor, root_token: torch.Tensor, options, vocab_size: int,
                      generator) -> tuple[DraftTree, torch.Tensor]:
    """logits (k, Vd) of the k chain positions, each read without the drafts before it (P-EAGLE, DFlash) -> (the
    chain after `root_token`, its (k+1, k+1) ancestors-or-self mask). Greedy at temperature 0, else draft j is drawn
    from q_j (`options`: temperature, top_k, top_p), kept as the tree's draft_probs for the chain's p/q rule."""
    k, device = logits.shape[0], logits.device
    all_draft_ids = drafter.draft_to_target(torch.arange(logits.shape[-1], device=device))  # (Vd,)
    parents = chain_parents(k, device)  # (k+1,)
    draft_probs = None
    if options.temperature > 0:
        q = logits_to_probs(logits, options.temperature, options.top_k, options.top_p)  # (k, Vd)
        draft_ids = sample(q, generator)  # (k,) one uniform per row, drawn as one (k, 1) tensor
        q_target = draft_probs_to_target(q, all_draft_ids, vocab_size)  # (k, V)
        draft_probs = torch.cat([torch.zeros_like(q_target[:1]), q_target])  # (k+1, V) the root has none
    else:
        draft_ids = logits.argmax(-1)  # (k,)
    tokens = torch.cat([root_token.reshape(1), all_draft_ids[draft_ids]])  # (k+1,)
    tree = DraftTree(tokens, parents, torch.arange(k + 1, device=device), draft_probs=draft_probs)
    return tree, ancestor_matrix(parents, k)


TOPK_CHUNK = 128  # columns per chunk in the first pass of `top_k_rows`


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k, dim=-1)` of a (R, V) tensor -> (values, indices) (R, k), best first.

    k = 1 is an argmax (one reduction kernel; ties go to the lowest index, as `torch.argmax` documents).
    Rows of at least 4 chunks go in two passes: the top k of every chunk of `TOPK_CHUNK` columns, then
    the top k of the row's V / TOPK_CHUNK * k candidates. One `topk` over a draft-vocabulary row
    (4k-32k columns) runs as one thread block per row and took 48 us for 8 rows of 8,192 on an H200;
    chunked, the first pass spreads over R * V / TOPK_CHUNK blocks. The top-k values are exactly
    `torch.topk`'s (only the order among equal values may differ)."""
    rows, width = x.shape
    if k == 1:
        ids = x.argmax(dim=-1, keepdim=True)
        return x.gather(-1, ids), ids
    chunks = width // TOPK_CHUNK
    if TOPK_CHUNK < k or chunks < 4 or width % TOPK_CHUNK:
        return torch.topk(x, k, dim=-1)
    part_values, part_ids = torch.topk(x.view(rows, chunks, TOPK_CHUNK), k, dim=-1)  # (R, C, k)
    values, best = torch.topk(part_values.reshape(rows, chunks * k), k, dim=-1)  # (R, k)
    columns = part_ids + torch.arange(0, width, TOPK_CHUNK, device=x.device)[None, :, None]  # (R, C, k)
    return values, columns.reshape(rows, chunks * k).gather(1, best)


def expand_candidates(
    frontier_scores: torch.Tensor,  # (k,) cumulative log-prob of the nodes being expanded
    child_logits: torch.Tensor,  # (k, Vd) drafter logits (or log-probs) of each node's next token
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k children of every frontier node -> (draft ids (k*top_k,), cumulative scores (k*top_k,),
    frontier slot of each candidate's parent (k*top_k,)). Children of node j come as a block, best first.

    The top k are taken on the logits as they come (bf16 on a GPU) and only their log-probs are formed,
    in float32: logit - logsumexp(logits), the values `log_softmax(logits.float())` has there."""
    values, ids = top_k_rows(child_logits, top_k)  # (k, top_k)
    log_norm = torch.logsumexp(child_logits.float(), dim=-1, keepdim=True)  # (k, 1)
    scores = frontier_scores[:, None] + (values.float() - log_norm)  # (k, top_k)
    slots = torch.arange(frontier_scores.shape[0], device=ids.device)[:, None].expand_as(ids)
    return ids.reshape(-1), scores.reshape(-1), slots.reshape(-1)


def sample_candidates(
    frontier_scores: torch.Tensor,  # (k,) cumulative log-prob of the nodes being expanded
    child_probs: torch.Tensor,  # (k, Vd) drafter distribution of each node's next token
    top_k: int,
    generator: torch.Generator | PreDrawn | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_k` children of every frontier node drawn WITHOUT replacement from its distribution, in draw
    order -> as `expand_candidates`. Gumbel top-k: the k largest log q(x) - log(-log u(x)) are k draws
    without replacement, largest first. A child's score is its parent's plus the j-th largest log q among
    its node's draws, so scores fall in draw order and `select_nodes` keeps a prefix of every node's draws,
    which is what the verification's sibling order needs (`verify.rejection_tree_tokens`). Rows whose q
    has fewer than top_k tokens get fillers with q = 0, score -inf: never accepted."""
    log_q = child_probs.float().log()  # -inf outside q's support
    u = rand(tuple(child_probs.shape), generator, child_probs.device).clamp(min=torch.finfo(torch.float32).tiny)
    _, ids = top_k_rows(log_q - torch.log(-torch.log(u)), top_k)  # (k, top_k) in draw order
    ranked = torch.sort(log_q.gather(1, ids), dim=-1, descending=True).values
    scores = frontier_scores[:, None] + ranked
    slots = torch.arange(frontier_scores.shape[0], device=ids.device)[:, None].expand_as(ids)
    return ids.reshape(-1), scores.reshape(-1), slots.reshape(-1)


def next_frontier(candidate_scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices of the `top_k` best candidates (by cumulative log-prob) to expand at the next depth."""
    k = min(top_k, candidate_scores.shape[0])
    return top_k_rows(candidate_scores[None], k)[1][0]


def select_nodes(scores: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The `total_tokens` best pool entries by cumulative log-prob, as ascending pool indices.

    Pool entries are appended depth by depth, so a parent has a lower index than its children and a
    score no smaller (log-probs are <= 0). A stable descending sort breaks ties by lower index, hence
    every kept node's parent is kept too: the selection is a tree.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:total_tokens]
    return torch.sort(order).values


def build_tree(
    root_token: torch.Tensor,  # () target id of the root
    pool_tokens: torch.Tensor,  # (P,) target ids
    pool_scores: torch.Tensor,  # (P,)
    pool_parents: torch.Tensor,  # (P,) pool index of the parent, -1 for children of the root
    pool_depths: torch.Tensor,  # (P,) 1 for children of the root
    total_tokens: int,
    child_probs: torch.Tensor | None = None,  # (R, V) sampled trees: the distribution a node's children came from
    child_owner: torch.Tensor | None = None,  # (R,) pool index of that node, -1 for the root
) -> DraftTree:
    """Keep the best `total_tokens` pool nodes and re-index them as a flat tree rooted at node 0 (with the
    kept nodes' `child_probs` rows, zeros for nodes whose children were not drawn)."""
    keep = select_nodes(pool_scores, total_tokens)  # (N-1,) ascending pool indices
    new_index = torch.full((pool_tokens.shape[0] + 1,), -1, dtype=torch.long, device=keep.device)
    new_index[keep] = torch.arange(1, keep.shape[0] + 1, device=keep.device)
    kept_parents = pool_parents[keep]
    parents = torch.where(kept_parents < 0, torch.zeros_like(kept_parents), new_index[kept_parents.clamp(min=0)])
    minus_one = torch.full((1,), -1, dtype=torch.long, device=keep.device)
    rows = None
    if child_probs is not None:
        n = keep.shape[0] + 1
        node = torch.where(child_owner < 0, torch.zeros_like(child_owner), new_index[child_owner.clamp(min=0)])
        rows = child_probs.new_zeros(n + 1, child_probs.shape[-1])  # row n takes the rows of pruned nodes
        rows = rows.index_copy(0, torch.where(node < 0, torch.full_like(node, n), node), child_probs)[:n]
    return DraftTree(
        tokens=torch.cat([root_token.reshape(1), pool_tokens[keep]]),
        parents=torch.cat([minus_one, parents]),
        depths=torch.cat([torch.zeros(1, dtype=torch.long, device=keep.device), pool_depths[keep]]),
        child_probs=rows,
    )


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(N, N) bool, [i, j] True when j is i itself or an ancestor of i. `max_depth` bounds the tree depth."""
    n = parents.shape[0]
    ancestors = torch.eye(n, dtype=torch.bool, device=parents.device)
    current = parents.clone()
    for _ in range(max_depth):  # scatter, not boolean indexing: no host synchronisation
        valid = current >= 0
        ancestors |= torch.zeros_like(ancestors).scatter_(1, current.clamp(min=0)[:, None], valid[:, None])
        current = torch.where(valid, parents[current.clamp(min=0)], current)
    return ancestors


def tree_attention_mask(parents: torch.Tensor, max_depth: int, prefix_length: int) -> torch.Tensor:
    """(N, prefix_length + N) bool, True = attend: every node sees the whole prefix and its ancestors."""
    tree = ancestor_matrix(parents, max_depth)
    prefix = torch.ones(parents.shape[0], prefix_length, dtype=torch.bool, device=parents.device)
    return torch.cat([prefix, tree], dim=1)


def causal_mask(new_length: int, prefix_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, prefix_length + T) bool causal mask for T new tokens after a prefix."""
    tri = torch.ones(new_length, new_length, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(new_length, prefix_length, dtype=torch.bool, device=device), tri], dim=1)


def extend_ancestry(ancestry: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
    """Grow the (E, E) ancestry of expanded draft slots by k new slots whose parents are `parent_slots`
    (k,) (-1 = the root, which has no slot) -> (E+k, E+k) bool, ancestors-or-self."""
    e, k = ancestry.shape[0], parent_slots.shape[0]
    device = parent_slots.device
    grown = torch.zeros(e + k, e + k, dtype=torch.bool, device=device)
    grown[:e, :e] = ancestry
    if e:
        inherited = ancestry[parent_slots.clamp(min=0)] & (parent_slots >= 0)[:, None]  # (k, E)
        grown[e:, :e] = inherited
    grown[e:, e:] = torch.eye(k, dtype=torch.bool, device=device)
    return grown

