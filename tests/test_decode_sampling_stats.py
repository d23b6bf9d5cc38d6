"""Statistical test: speculative sampling (chain with sampled drafts, tree with top-k drafts, tree with
children drawn without replacement) emits tokens with exactly the target's distribution.

A bigram "target" P[a] and a different "drafter" Q[a] over a 5-token vocabulary; each trial runs
speculative steps (pure functions only) until two tokens are out. The empirical distribution of the
pair (x1, x2) over 25 cells is compared with P[root, x1] * P[x1, x2] by Pearson's chi-square with a
fixed seed. Threshold: the 0.999 quantile of chi-square with 24 degrees of freedom, 51.18.
"""

from __future__ import annotations

import pytest
import torch

from eaglekit.decode.sampling import sample
from eaglekit.decode.tree import DraftTree, ancestor_matrix, chain_parents, sample_candidates
from eaglekit.decode.verify import verify_sampled_chain, verify_sampled_tree, verify_sampling

V, TRIALS, CHI2_999_DF24 = 5, 4000, 51.18


def _tables():
    g = torch.Generator().manual_seed(11)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return target, draft


def _chain(root: int, draft: torch.Tensor, g: torch.Generator, length: int = 2) -> DraftTree:
    tokens, qs = [root], [torch.zeros(V)]
    for _ in range(length):
        q = draft[tokens[-1]]
        tokens.append(int(sample(q, g)))
        qs.append(q)
    return DraftTree(torch.tensor(tokens), chain_parents(length), torch.arange(length + 1), torch.stack(qs))


def _tree(root: int, draft: torch.Tensor, g: torch.Generator) -> DraftTree:
    """Root -> its 3 most likely draft tokens; the first child -> its 2 most likely (deterministic)."""
    kids = torch.topk(draft[root], 3).indices.tolist()
    grandkids = torch.topk(draft[kids[0]], 2).indices.tolist()
    tokens = [root] + kids + grandkids
    return DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 2, 2]))


def _without_replacement(q: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The distribution each of `ids` (drawn in turn without replacement from q) was drawn from."""
    rows, left = [], q.clone()
    for i in ids:
        rows.append(left / left.sum())
        left[i] = 0.0
    return torch.stack(rows)


def _sampled_tree(root: int, draft: torch.Tensor, g: torch.Generator) -> DraftTree:
    """Root -> 3 children drawn without replacement from draft[root] (`sample_candidates`); the first
    child -> 2 drawn from draft[child]. child_probs: what each node's children came from; draft_probs:
    what each node itself was drawn from (the sequential reference's input)."""
    kids = sample_candidates(torch.zeros(1), draft[root][None], 3, g)[0].tolist()
    grandkids = sample_candidates(torch.zeros(1), draft[kids[0]][None], 2, g)[0].tolist()
    tokens = [root] + kids + grandkids
    child_probs = torch.zeros(6, V)
    child_probs[0], child_probs[1] = draft[root], draft[kids[0]]
    drawn_from = torch.cat([torch.zeros(1, V), _without_replacement(draft[root], kids), _without_replacement(draft[kids[0]], grandkids)])
    return DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 2, 2]),
                     draft_probs=drawn_from, child_probs=child_probs)


def _pairs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft = _tables()
    g = torch.Generator().manual_seed(5)
    root, counts = 0, torch.zeros(V, V)
    for _ in range(TRIALS):
        out, last = [], root
        while len(out) < 2:
            tree = (_chain if kind.startswith("chain") else _sampled_tree if kind.startswith("sampled") else _tree)(last, draft, g)
            if kind == "sampled_tree_on_device":
                verdict = verify_sampled_tree(tree.tokens, tree.parents, ancestor_matrix(tree.parents, 2), target[tree.tokens], g,
                                              tree.child_probs, 3)
            elif kind == "chain_on_device":
                verdict = verify_sampled_chain(tree.tokens, target[tree.tokens], tree.draft_probs, g)
            elif kind == "tree_on_device":
                verdict = verify_sampled_tree(tree.tokens, tree.parents, ancestor_matrix(tree.parents, 2), target[tree.tokens], g)
            else:
                verdict = verify_sampling(tree.tokens, tree.parents, target[tree.tokens], tree.draft_probs, g)
            out += verdict.tokens + [verdict.bonus]
            last = out[-1]
        counts[out[0], out[1]] += 1
    expected = TRIALS * target[root][:, None] * target
    return counts, expected


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("kind", ["chain", "chain_on_device"])
def test_chain_speculative_sampling_matches_target(kind):
    """The sequential rule, and its all-positions-at-once form that the decoder runs for sampled chains."""
    counts, expected = _pairs(kind)
    assert _chi_square(counts, expected) < CHI2_999_DF24


@pytest.mark.parametrize("kind", ["tree", "tree_on_device", "sampled_tree", "sampled_tree_on_device"])
def test_tree_multi_draft_sampling_matches_target(kind):
    """The sequential multi-draft rule, and the forms the decoder runs: one draw per node for top-k
    children, recursive rejection at every node at once for children drawn without replacement."""
    counts, expected = _pairs(kind)
    assert _chi_square(counts, expected) < CHI2_999_DF24


def test_chi_square_detects_a_wrong_rule():
    """Sanity check of the test's power: accepting every draft (no rejection) fails the threshold."""
    target, draft = _tables()
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        x1 = int(sample(draft[0], g))
        counts[x1, int(sample(draft[x1], g))] += 1
    assert _chi_square(counts, TRIALS * target[0][:, None] * target) > CHI2_999_DF24


@pytest.mark.parametrize("rule", ["sequential", "on_device"])
def test_multi_draft_acceptance_is_the_childrens_target_mass(rule):
    """Lossless is not enough: trying the siblings in turn must accept with probability sum p(child).
    (Trying only the first child would keep the output distribution exact and pass the chi-square tests,
    at a lower acceptance rate.)"""
    p = torch.tensor([0.3, 0.2, 0.1, 0.25, 0.1, 0.05])
    tokens, parents = torch.tensor([5, 0, 1, 2]), torch.tensor([-1, 0, 0, 0])  # the root and 3 deterministic children
    ancestors = ancestor_matrix(parents, 1)
    generator = torch.Generator().manual_seed(0)
    trials = 20000

    def verdict():
        if rule == "sequential":
            return verify_sampling(tokens, parents, p.expand(4, -1), None, generator)
        return verify_sampled_tree(tokens, parents, ancestors, p.expand(4, -1), generator)

    accepted = sum(verdict().num_accepted > 0 for _ in range(trials))
    assert abs(accepted / trials - 0.6) < 0.015  # 0.3 + 0.2 + 0.1; the standard error is 0.0035


@pytest.mark.parametrize("rule", ["sequential", "on_device"])
def test_chain_acceptance_is_the_overlap_of_p_and_q(rule):
    """One sampled draft is accepted with probability sum_x min(p(x), q(x)) (here 0.7)."""
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.3, 0.2, 0.3])
    generator = torch.Generator().manual_seed(0)
    probs, drafts = torch.stack([p, p]), torch.stack([torch.zeros(4), q])
    trials, accepted = 20000, 0
    for _ in range(trials):
        tokens = torch.stack([torch.tensor(3), sample(q, generator)])
        if rule == "sequential":
            verdict = verify_sampling(tokens, chain_parents(1), probs, drafts, generator)
        else:
            verdict = verify_sampled_chain(tokens, probs, drafts, generator)
        accepted += verdict.num_accepted
    assert abs(accepted / trials - 0.7) < 0.015


def test_children_drawn_without_replacement_accept_as_recursive_rejection_says():
    """Lossless is not enough here either: two children drawn without replacement from q are accepted
    with P = sum min(p, q) + sum_x1 max(0, q - p)(x1) * sum min(p2, q2[x1]), where p2 = norm(max(0, p - q))
    and q2[x1] = q without x1, renormalised (computed exactly below). Here that is 0.790 against 0.70 for
    one sampled draft, and 0.3 for q's two most likely tokens as one-hot children."""
    p, q = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1]), torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    overlap = float(torch.minimum(p, q).sum())
    p2 = (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    second = sum(float((q[x] - p[x]).clamp(min=0)) * float(torch.minimum(p2, _without_replacement(q, [x, x])[1]).sum())
                 for x in range(5))
    exact = overlap + second
    tokens, parents = torch.tensor([0, 0, 0]), torch.tensor([-1, 0, 0])
    ancestors, child_probs = ancestor_matrix(parents, 1), torch.stack([q, torch.zeros(5), torch.zeros(5)])
    g, trials, accepted = torch.Generator().manual_seed(0), 20000, 0
    for _ in range(trials):
        tokens[1:] = sample_candidates(torch.zeros(1), q[None], 2, g)[0]
        accepted += verify_sampled_tree(tokens, parents, ancestors, p.expand(3, -1), g, child_probs, 2).num_accepted
    assert exact > overlap + 0.05
    assert abs(accepted / trials - exact) < 0.015, (accepted / trials, exact)
