"""Verification of a drafted chain or tree against the target's logits at every node.

Pure tensor functions, no model calls. Node i's target logits predict the token AFTER node i, so
node c (child of p) is correct when it matches what the target produces after p.

- Greedy: the deepest node whose whole root path is correct; the bonus token is the target's
  argmax after it. Reproduces target greedy decoding token for token.
- Sampling: at each node, the children are tried in order with recursive rejection sampling: child
  x drawn from q is accepted with probability min(1, p(x) / q(x)); on rejection the target
  distribution becomes norm(max(0, p - q)) and the next sibling is tried. When no child is accepted
  (or the node is a leaf) the bonus token is drawn from the current residual. Deterministic children
  (EAGLE-2 top-k trees) have q = one-hot, which makes the rule "accept with p(x), else remove x".
  For one candidate per node this is the speculative-sampling rule of Leviathan et al. / Chen et al.;
  for several it is SpecInfer's multi-draft rule. Either way the output follows the target exactly.
  For one-hot drafts the rule equals "draw x ~ p at every node, follow the child whose token is x"
  (`verify_sampled_tree`). At temperature > 0 the decoder draws a tree's children without replacement
  from the drafter's distribution and runs the rule for every node at once (`rejection_tree_tokens`),
  then follows the emitted tokens down the tree: one host sync. For a
  chain of sampled drafts the decoder runs `verify_sampled_chain`, the same rule for all positions at
  once. `verify_sampling` (the rule as written, on the host) is the reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglekit.decode.sampling import PreDrawn, rand, sample


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root first (len = accepted drafts + 1)
    tokens: list[int]  # the accepted draft tokens (the path's nodes after the root)
    bonus: int  # the target's own next token after the last accepted node
    path_tensor: torch.Tensor  # (len(path),) `path` on the device, so the decode loop need not copy it back
    bonus_tensor: torch.Tensor  # (1,) `bonus` on the device

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def greedy_path(
    tokens: torch.Tensor,  # (N,) node tokens, root first
    parents: torch.Tensor,  # (N,) -1 for the root
    ancestors: torch.Tensor,  # (N, N) bool ancestors-or-self (`tree.ancestor_matrix`)
    target_ids: torch.Tensor,  # (N,) target argmax after each node
    limit: torch.Tensor | None = None,  # () the deepest depth verified (a confidence cut); None = every node
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The longest correct root path, on the device with nothing read back -> (on_path (N,) bool, order (N,):
    the path's nodes first in tree order (root first), then the rest; bonus (1,): the target's token after it).
    The path length is on_path.sum(). Tensor indexing throughout, not `[best]`: that would read `best` back.
    Nodes deeper than `limit` are not verified: they count as wrong, so the bonus comes after at most `limit`."""
    correct = (tokens == target_ids[parents.clamp(min=0)]) | (parents < 0)  # (N,) the root is the target's own token
    depth = ancestors.sum(dim=1)  # (N,) 1 + depth
    if limit is not None:
        correct = correct & (depth <= limit + 1)
    path_ok = ~(ancestors & ~correct[None, :]).any(dim=1)  # (N,) every ancestor-or-self correct
    best = torch.argmax(torch.where(path_ok, depth, torch.zeros_like(depth))).reshape(1)  # first deepest correct node
    on_path = ancestors.index_select(0, best)[0]  # (N,)
    order = torch.sort((~on_path).to(torch.uint8), stable=True).indices  # path nodes first, in tree order
    return on_path, order, target_ids.index_select(0, best)


def verify_greedy(
    tokens: torch.Tensor,  # (N,) node tokens, root first
    parents: torch.Tensor,  # (N,) -1 for the root
    ancestors: torch.Tensor,  # (N, N) bool ancestors-or-self (`tree.ancestor_matrix`)
    target_ids: torch.Tensor,  # (N,) target argmax after each node
    limit: torch.Tensor | None = None,  # () the deepest depth verified; None = every node
) -> Verdict:
    """Longest correct root path (`greedy_path`), with a single transfer to the host."""
    on_path, order, bonus = greedy_path(tokens, parents, ancestors, target_ids, limit)
    n = tokens.shape[0]
    host = torch.cat([on_path.long(), tokens, bonus]).tolist()  # the one host sync of a step
    path = [i for i, on in enumerate(host[:n]) if on]
    return Verdict(path=path, tokens=[host[n + i] for i in path[1:]], bonus=int(host[-1]),
                   path_tensor=order[: len(path)], bonus_tensor=bonus)


def child_table(parents: torch.Tensor, width: int) -> torch.Tensor:
    """(N,) parents -> (N, width): node index of each node's j-th child in node order, -1 where none."""
    n = parents.shape[0]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # (N, N): j < i
    siblings_before = ((parents[:, None] == parents[None, :]) & earlier).sum(1)  # (N,)
    # n * width: unused
    slot = torch.where((parents >= 0) & (siblings_before < width), parents * width + siblings_before, n * width)
    table = torch.full((n * width + 1,), -1, dtype=torch.long, device=parents.device)
    return table.scatter(0, slot, torch.arange(n, device=parents.device))[:-1].view(n, width)


def rejection_tree_tokens(
    tokens: torch.Tensor,  # (N,) node tokens, root first; each node's children in the order they were drawn
    parents: torch.Tensor,  # (N,)
    target_probs: torch.Tensor,  # (N, V) processed target distribution after each node
    child_probs: torch.Tensor,  # (N, V) the distribution each node's children were drawn from (zeros for leaves)
    width: int,  # most children of a node
    generator: torch.Generator | PreDrawn | None = None,
) -> torch.Tensor:
    """The token the target emits after every node, for children drawn WITHOUT replacement from q (all nodes
    at once, on the device) -> (N,).

    Recursive rejection sampling over the children in draw order: child x is accepted with
    min(1, p(x) / q(x)); on rejection p becomes norm(max(0, p - q)) and q loses x (renormalised), the
    distribution the next child was drawn from. With no child accepted, the token is drawn from the last
    residual. Each step emits p's token exactly, whatever proposal it tried (the induction of Jeon et al.,
    "Recursive Speculative Decoding", 2024), so following the child whose token was emitted, as for greedy
    trees, is lossless. Against one-hot top-k children it keeps the drafter's spread: with a diffuse
    target (temperature 1) the top-k tokens may hold little of p where q's draws overlap p widely."""
    n = tokens.shape[0]
    tiny = torch.finfo(torch.float32).tiny
    p = target_probs.float()
    p = p / p.sum(-1, keepdim=True)
    q = child_probs.float()
    q = q / q.sum(-1, keepdim=True).clamp(min=tiny)
    children = child_table(parents, width)
    uniforms = rand((n, width), generator, p.device)
    emitted = torch.full((n,), -1, dtype=torch.long, device=p.device)
    done = torch.zeros(n, dtype=torch.bool, device=p.device)
    for j in range(width):
        child = children[:, j]
        x = tokens[child.clamp(min=0)][:, None]  # (N, 1)
        qx, px = q.gather(1, x)[:, 0], p.gather(1, x)[:, 0]
        tried = (child >= 0) & ~done & (qx > 0)  # q(x) = 0: a filler past q's support, never drawn
        accepted = tried & (uniforms[:, j] * qx < px)
        emitted = torch.where(accepted, x[:, 0], emitted)
        done = done | accepted
        rejected = (tried & ~accepted)[:, None]
        residual = (p - q).clamp(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        p = torch.where(rejected & (mass > 0), residual / mass.clamp(min=tiny), p)  # p == q up to rounding: keep p
        q = torch.where(rejected, q.scatter(1, x, 0.0), q)
        q = q / q.sum(-1, keepdim=True).clamp(min=tiny)
    return torch.where(done, emitted, sample(p, generator))


def verify_sampled_tree(
    tokens: torch.Tensor,  # (N,) node tokens, root first; siblings distinct
    parents: torch.Tensor,  # (N,)
    ancestors: torch.Tensor,  # (N, N) bool ancestors-or-self
    target_probs: torch.Tensor,  # (N, V) processed target distribution after each node
    generator: torch.Generator | None = None,
    child_probs: torch.Tensor | None = None,  # (N, V) sampled children: the distribution they were drawn from
    width: int = 0,  # sampled children: most children of a node
) -> Verdict:
    """Sampling verification of a tree on the device, with one host sync.

    Deterministic drafts (child_probs None, e.g. top-k children): the recursive rule at a node (accept
    child c with p'(c), else remove c from p and renormalise) accepts child c with probability exactly
    p(c) and otherwise emits x with p(x): the same as drawing x ~ p once and following the child whose
    token is x, x being the bonus when no child has it. So one draw per node, all at once, and the greedy
    walk over the draws give the same output distribution as `verify_sampling`. Children drawn without
    replacement from child_probs: `rejection_tree_tokens` gives each node's emitted token, walked the same way."""
    if child_probs is None:
        emitted = sample(target_probs, generator)
    else:
        emitted = rejection_tree_tokens(tokens, parents, target_probs, child_probs, width, generator)
    return verify_greedy(tokens, parents, ancestors, emitted)


def sampled_chain_path(
    tokens: torch.Tensor,  # (k+1,) the root, then k drafts
    target_probs: torch.Tensor,  # (k+1, V) processed target distribution after each node
    draft_probs: torch.Tensor,  # (k+1, V) row i: the distribution draft i was drawn from (row 0 unused)
    generator: torch.Generator | PreDrawn | None = None,
    limit: torch.Tensor | None = None,  # () drafts verified (a confidence cut); None = all k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain of sampled drafts, on the device with nothing read back -> (count ():
    accepted drafts, bonus (1,)).

    Draft i is accepted with min(1, p(x_i) / q(x_i)) while all before it were; at the first rejection the
    bonus is drawn from norm(max(0, p - q)) there (p itself if that is empty), after k accepts from the last
    p: `verify_sampling`'s rule for a chain, all positions at once. Drafts from `limit` on are not verified: the
    chain is as if cut there (after `limit` accepts the bonus is drawn from p at the cut)."""
    k = tokens.shape[0] - 1
    p, q = target_probs[:-1].float(), draft_probs[1:].float()  # (k, V): p before draft i, q it was drawn from
    drafts = tokens[1:, None]
    ratio = p.gather(1, drafts)[:, 0] / q.gather(1, drafts)[:, 0].clamp(min=1e-30)  # (k,)
    accepted = rand((k,), generator, p.device) < ratio
    if limit is not None:
        verified = torch.arange(k, device=p.device) < limit  # (k,)
        accepted = accepted & verified
        q = q * verified[:, None]  # past the cut nothing was proposed: the bonus comes from p itself
    count = accepted.long().cumprod(0).sum()  # () leading accepts
    residual = (p - q).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q up to rounding: keep p
    rows = torch.cat([residual, target_probs[-1:].float()])  # (k+1, V): the bonus distribution per outcome
    return count, sample(rows.index_select(0, count.reshape(1)), generator)


def verify_sampled_chain(
    tokens: torch.Tensor,  # (k+1,) the root, then k drafts
    target_probs: torch.Tensor,  # (k+1, V) processed target distribution after each node
    draft_probs: torch.Tensor,  # (k+1, V) row i: the distribution draft i was drawn from (row 0 unused)
    generator: torch.Generator | None = None,
    limit: torch.Tensor | None = None,  # () drafts verified; None = all
) -> Verdict:
    """`sampled_chain_path` with one host sync."""
    count, bonus = sampled_chain_path(tokens, target_probs, draft_probs, generator, limit)
    host = torch.cat([count.reshape(1), tokens, bonus]).tolist()  # the one host sync of a step
    n = host[0]
    return Verdict(path=list(range(n + 1)), tokens=host[2 : n + 2], bonus=int(host[-1]),
                   path_tensor=torch.arange(n + 1, device=tokens.device), bonus_tensor=bonus)


def recursive_rejection(
    target_probs: torch.Tensor,  # (V,) p at the current node
    candidates: list[int],  # sibling tokens, in the order they are tried
    draft_probs: torch.Tensor | None,  # (j, V) the distribution each sibling was drawn from; None = one-hot
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """Try the siblings in order -> (index of the accepted sibling or -1, residual distribution (V,))."""
    p = target_probs.float()
    uniforms = torch.rand(len(candidates), generator=generator, device=p.device).tolist() if candidates else []
    for i, token in enumerate(candidates):
        q = draft_probs[i].float() if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        p_token = float(p[token])
        if q_token > 0 and uniforms[i] < min(1.0, p_token / q_token):
            return i, p
        if q is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: nothing left to reject towards; keep p
            continue
        p = residual / total
    return -1, p


def verify_sampling(
    tokens: torch.Tensor,  # (N,) node tokens, root first
    parents: torch.Tensor,  # (N,)
    target_probs: torch.Tensor,  # (N, V) processed target distribution after each node
    draft_probs: torch.Tensor | None = None,  # (N, V) distribution node i was drawn from; None = deterministic
    generator: torch.Generator | None = None,
) -> Verdict:
    """Walk down the tree with recursive rejection sampling over each node's children."""
    token_list, parent_list = tokens.tolist(), parents.tolist()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parent_list):
        if parent >= 0:
            children.setdefault(parent, []).append(node)
    node, path = 0, [0]
    while True:
        kids = children.get(node, [])
        rows = draft_probs[kids] if (draft_probs is not None and kids) else None
        chosen, residual = recursive_rejection(target_probs[node], [token_list[c] for c in kids], rows, generator)
        if chosen < 0:
            bonus = int(sample(residual, generator))
            return Verdict(path=path, tokens=[token_list[i] for i in path[1:]], bonus=bonus,
                           path_tensor=torch.tensor(path, device=tokens.device),
                           bonus_tensor=torch.tensor([bonus], device=tokens.device))
        node = kids[chosen]
        path.append(node)
