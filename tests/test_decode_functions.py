"""Pure decode functions: sampling filters, tree growth/selection/masks, greedy and sampling verification."""

from __future__ import annotations

import pytest
import torch

from eaglekit.decode.sampling import draft_probs_to_target, logits_to_probs, sample
from eaglekit.decode.tree import (
    ancestor_matrix, build_tree, causal_mask, chain_parents, expand_candidates, extend_ancestry, sample_candidates, select_nodes,
    top_k_rows, tree_attention_mask,
)
from eaglekit.decode.verify import child_table, recursive_rejection, verify_greedy, verify_sampling


def test_logits_to_probs_filters():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.equal(logits_to_probs(logits, 0.0), torch.tensor([1.0, 0, 0, 0]))
    top2 = logits_to_probs(logits, 1.0, top_k=2)
    assert torch.allclose(top2, torch.tensor([0.7311, 0.2689, 0.0, 0.0]), atol=1e-4)
    full = logits.softmax(0)  # [0.644, 0.237, 0.087, 0.032]: top_p 0.85 keeps the two that reach it
    nucleus = logits_to_probs(logits, 1.0, top_p=0.85)
    assert torch.allclose(nucleus, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]), atol=1e-6)
    hot = logits_to_probs(logits, 0.5)
    assert torch.allclose(hot, (logits / 0.5).softmax(0))


def test_sample_follows_probs():
    probs = torch.tensor([0.1, 0.6, 0.3])
    generator = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, 3), generator)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_draft_probs_to_target_scatters():
    q = torch.tensor([[0.5, 0.25, 0.25]])
    out = draft_probs_to_target(q, torch.tensor([1, 4, 5]), 6)
    assert out.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.25, 0.25]]


def test_expand_and_select_build_a_closed_tree():
    frontier = torch.tensor([-0.1, -2.0])
    logp = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    ids, scores, slots = expand_candidates(frontier, logp, 2)
    assert ids.tolist() == [0, 1, 2, 0] and slots.tolist() == [0, 0, 1, 1]
    expected = torch.tensor([-0.1, -0.1, -2.0, -2.0]) + torch.log(torch.tensor([0.7, 0.2, 0.8, 0.1]))
    assert torch.allclose(scores, expected)
    # pool: two depth-1 nodes then four depth-2 children (parents are pool indices)
    pool_scores = torch.tensor([-0.1, -2.0, -0.46, -1.7, -2.2, -4.3])
    pool_parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    assert select_nodes(pool_scores, 4).tolist() == [0, 1, 2, 3]
    tree = build_tree(torch.tensor(7), torch.tensor([10, 11, 12, 13, 14, 15]), pool_scores, pool_parents,
                      torch.tensor([1, 1, 2, 2, 2, 2]), 5)
    assert tree.tokens.tolist() == [7, 10, 11, 12, 13, 14]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]


def test_select_nodes_ties_keep_parents():
    # a child with probability 1 ties with its parent: the parent (lower index) must win the tie
    assert select_nodes(torch.tensor([-0.5, -0.7, -0.5]), 1).tolist() == [0]
    assert select_nodes(torch.tensor([-0.5, -0.7, -0.5]), 2).tolist() == [0, 2]


def test_ancestor_matrix_and_masks():
    parents = torch.tensor([-1, 0, 0, 1, 3])
    anc = ancestor_matrix(parents, max_depth=4)
    assert anc.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    mask = tree_attention_mask(parents, 4, prefix_length=2)
    assert mask.shape == (5, 7) and bool(mask[:, :2].all()) and torch.equal(mask[:, 2:], anc)
    assert torch.equal(ancestor_matrix(chain_parents(3), 3), torch.ones(4, 4, dtype=torch.bool).tril())
    assert causal_mask(2, 1).int().tolist() == [[1, 1, 0], [1, 1, 1]]


def test_extend_ancestry():
    a = extend_ancestry(torch.zeros(0, 0, dtype=torch.bool), torch.tensor([-1, -1]))
    assert a.int().tolist() == [[1, 0], [0, 1]]
    b = extend_ancestry(a, torch.tensor([1, 0]))
    assert b.int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]]


def test_verify_greedy_longest_path():
    tokens = torch.tensor([7, 3, 4, 5, 6])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    anc = ancestor_matrix(parents, 2)
    # target after node0 -> 4, after node2 -> 6, after node4 -> 9: path 0-2-4, bonus 9
    verdict = verify_greedy(tokens, parents, anc, torch.tensor([4, 0, 6, 0, 9]))
    assert verdict.path == [0, 2, 4] and verdict.tokens == [4, 6] and verdict.bonus == 9
    none = verify_greedy(tokens, parents, anc, torch.tensor([8, 0, 6, 0, 9]))
    assert none.path == [0] and none.tokens == [] and none.bonus == 8


def test_recursive_rejection_delta_and_residual():
    p = torch.tensor([0.0, 1.0, 0.0])
    chosen, _ = recursive_rejection(p, [1], None)
    assert chosen == 0  # p(x) = 1 is always accepted
    chosen, residual = recursive_rejection(p, [0, 2], None)
    assert chosen == -1 and residual.tolist() == [0.0, 1.0, 0.0]
    q = torch.tensor([[0.5, 0.0, 0.5]])
    chosen, residual = recursive_rejection(torch.tensor([0.25, 0.5, 0.25]), [2], q, torch.Generator().manual_seed(3))
    if chosen < 0:  # residual = norm(max(0, p - q)) = [0, 1, 0]
        assert residual.tolist() == [0.0, 1.0, 0.0]


def test_verify_sampling_accepts_sure_tokens():
    tokens, parents = torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 1])
    probs = torch.nn.functional.one_hot(torch.tensor([1, 2, 0]), 3).float()
    verdict = verify_sampling(tokens, parents, probs)
    assert verdict.path == [0, 1, 2] and verdict.tokens == [1, 2] and verdict.bonus == 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_rows_equals_topk(k):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096, generator=generator)  # 32 chunks: the two-pass path
    values, ids = top_k_rows(x, k)
    expected = torch.topk(x, k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(x.gather(1, ids), values)
    assert torch.equal(ids.sort(-1).values, expected.indices.sort(-1).values)
    short = x[:, :300]  # not a multiple of the chunk: one topk
    assert torch.equal(top_k_rows(short, k)[0], torch.topk(short, k, dim=-1).values)


def test_expand_candidates_normalises_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    frontier = torch.tensor([0.0, -1.0, -2.5])
    ids, scores, slots = expand_candidates(frontier, logits, 4)
    logp = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(scores, (frontier[:, None] + logp.gather(1, ids.view(3, 4))).reshape(-1))
    assert slots.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_child_table_lists_children_in_node_order():
    parents = torch.tensor([-1, 0, 0, 1, 0, 1])
    assert child_table(parents, 3).tolist() == [[1, 2, 4], [3, 5, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert child_table(parents, 2)[0].tolist() == [1, 2]  # a third child past the width is left out


def test_sample_candidates_draws_without_replacement_in_draw_order():
    q = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.0, 0.0, 0.0, 0.6, 0.4]])
    g = torch.Generator().manual_seed(0)
    firsts = torch.zeros(5)
    for _ in range(4000):
        ids, scores, slots = sample_candidates(torch.tensor([0.0, -1.0]), q, 3, g)
        ids, scores = ids.view(2, 3), scores.view(2, 3)
        assert len(set(ids[0].tolist())) == 3 and 4 not in ids[0].tolist()  # distinct, never a token with q = 0
        assert torch.all(scores[:, :-1] >= scores[:, 1:])  # scores fall in draw order
        assert sorted(ids[1, :2].tolist()) == [3, 4] and scores[1, 2] == float("-inf")  # support of 2: a filler
        assert slots.tolist() == [0, 0, 0, 1, 1, 1]
        firsts[ids[0, 0]] += 1
    assert torch.allclose(firsts / 4000, q[0], atol=0.025)  # the first draw follows q


def test_build_tree_carries_each_kept_nodes_child_distribution():
    """Pool: root children 0, 1, 2; children of pool 1: 3, 4. Rows: the root's, pool 1's and pool 2's
    children distributions. Keeping 3 nodes (pool 0, 1, 3) drops pool 2, so its row goes too."""
    scores = torch.tensor([-0.1, -0.2, -3.0, -0.5, -4.0])
    rows, owners = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]), torch.tensor([-1, 1, 2])
    tree = build_tree(torch.tensor(9), torch.tensor([10, 11, 12, 13, 14]), scores, torch.tensor([-1, -1, -1, 1, 1]),
                      torch.tensor([1, 1, 1, 2, 2]), 3, rows, owners)
    assert tree.tokens.tolist() == [9, 10, 11, 13] and tree.parents.tolist() == [-1, 0, 0, 2]
    assert tree.child_probs.tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
