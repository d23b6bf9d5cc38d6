"""DSpark's heads and loss as pure functions: the Markov head over a block equals it stepped position by position,
the batched block loss equals the one-block-at-a-time reference (every head kind, both layouts, with and without the
confidence head), masks are contiguous prefixes, and the config refuses what cannot work."""

from __future__ import annotations

import pytest
import torch

from eaglekit.drafters.dflash.train import sample_anchors
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.dspark.train import (
    LossWeights,
    block_tokens,
    dspark_block_forward,
    naive_dspark_forward,
    prefix_masks,
    target_to_draft,
)
from eaglekit.errors import EaglekitError
from eaglekit.training.objective import soft_labels


def tiny_dspark(seed: int = 0, vocab: int = 40, draft_vocab: int = 24, block_size: int = 4, **heads) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = DSparkConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2, vocab_size=vocab, draft_vocab_size=draft_vocab,
                          target_hidden_size=16, target_layer_ids=(1, 3), mask_token_id=vocab - 1,
                          block_size=block_size, target_num_layers=6, **{"markov_rank": 8, **heads})
    drafter = DSparkDrafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)  # W2 included: a Markov bias that changes the logits
    drafter.set_vocab_mapping(torch.sort(torch.randperm(vocab)[:draft_vocab]).values)
    return drafter


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_block_bias_equals_the_head_stepped_left_to_right(kind: str) -> None:
    drafter = tiny_dspark(markov_head_type=kind)
    hidden, prev = torch.randn(2, 3, 4, 32), torch.randint(0, 40, (2, 3, 4))
    bias, e = drafter.markov_head.block_bias(prev, hidden)  # (2, 3, 4, Vd)
    state = None
    for k in range(4):
        step, step_e, state = drafter.markov_head.step(prev[..., k], hidden[..., k, :], state)
        torch.testing.assert_close(bias[..., k, :], step)
        torch.testing.assert_close(e[..., k, :], step_e)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    if kind == "vanilla":  # bias_k = W2 . W1[x_prev], W1 indexed by the target id
        torch.testing.assert_close(bias, w1[prev] @ w2.T)


def test_a_fresh_markov_head_starts_as_its_backbone() -> None:
    """W2 starts at zero: the corrected logits are the backbone's until training moves it (init_from a DFlash
    drafter starts exactly where that drafter was)."""
    torch.manual_seed(0)
    config = tiny_dspark().config
    drafter = DSparkDrafter(config)
    hidden, prev = torch.randn(3, 5, 32), torch.randint(0, 40, (3, 5))
    logits, e = drafter.markov_logits(hidden, prev)
    torch.testing.assert_close(logits, drafter.lm_head(hidden))
    assert e.abs().max() > 0 and drafter.markov_head.markov_w1.weight.std() < 0.02


def _batch(drafter: DSparkDrafter, seed: int = 0):
    torch.manual_seed(seed)
    b, t, v = 2, 12, drafter.config.vocab_size
    ids = torch.randint(0, v - 1, (b, t))
    loss_mask = torch.rand(b, t) > 0.25
    loss_mask[1, -3:] = False  # right padding
    aux = torch.randn(b, t, 2 * drafter.config.target_hidden_size)
    probs, in_vocab = soft_labels(torch.randn(b, t, v) * 3, drafter.t2d)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(1))
    return aux, ids, loss_mask, probs, in_vocab, anchors, valid


@pytest.mark.parametrize("heads", [
    {"markov_head_type": "vanilla"},
    {"markov_head_type": "gated"},
    {"markov_head_type": "rnn", "confidence_head_with_markov": False},
    {"markov_rank": 0, "confidence_head_with_markov": False},
    {"confidence_head": False},
    {"sample_from_anchor": False},
    {"sample_from_anchor": False, "markov_head_type": "rnn", "block_size": 3},
])
def test_block_forward_matches_the_one_block_reference(heads) -> None:
    drafter = tiny_dspark(**heads)
    batch = _batch(drafter)
    weights = LossWeights(ce=0.3, l1=0.6, confidence=0.5)
    fast = dspark_block_forward(drafter, *batch, 0.8, weights)
    naive = naive_dspark_forward(drafter, *batch, 0.8, weights)
    assert fast.train_counts.sum() > 0 and len(fast.loss_sums) == drafter.config.max_drafts
    torch.testing.assert_close(fast.loss, naive.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.loss_sums, naive.loss_sums, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.correct, naive.correct)
    assert torch.equal(fast.train_counts, naive.train_counts)
    assert torch.equal(fast.accuracy_counts, naive.accuracy_counts)
    fast.loss.backward()
    grads = [drafter.fc.weight.grad]
    if drafter.config.markov_rank:
        grads.append(drafter.markov_head.markov_w1.weight.grad)
    if drafter.config.confidence_head:
        grads.append(drafter.confidence_head.proj.weight.grad)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_masks_are_contiguous_prefixes_and_tokens_align() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[False, True, True, False, True, True]])
    in_vocab = torch.tensor([[True, False, True, True, True, True]])
    anchors, valid = torch.tensor([[0, 3]]), torch.tensor([[True, True]])
    train, accuracy = prefix_masks(loss_mask, in_vocab, anchors, valid, block_size=3, num_positions=3)
    # block a=0 drafts x1, x2 (assistant), x3 (not: the prefix stops there); block a=3 drafts x4, x5, then past the end
    assert accuracy.permute(1, 2, 0).tolist() == [[[True, True, False], [True, True, False]]]
    assert train.permute(1, 2, 0).tolist() == [[[True, False, False], [True, True, False]]]  # L1 not in vocab
    assert block_tokens(ids, anchors, 3, 3, 0).tolist() == [[[10, 11, 12], [13, 14, 15]]]  # previous tokens
    assert block_tokens(ids, anchors, 3, 3, 1).tolist() == [[[11, 12, 13], [14, 15, 15]]]  # drafted ones
    t2d = torch.tensor([False, True, True, False, True])
    assert target_to_draft(t2d).tolist() == [-1, 0, 1, -1, 2]


@pytest.mark.parametrize("bad, match", [
    ({"markov_rank": -1}, "markov_rank=-1"),
    ({"markov_head_type": "lstm"}, "markov_head_type='lstm'"),
    ({"markov_rank": 0, "confidence_head_with_markov": True}, "confidence_head_with_markov reads"),
    ({"confidence_temperatures": (1.0, 0.0)}, "must all be > 0"),
])
def test_the_config_refuses_heads_that_cannot_work(bad, match) -> None:
    with pytest.raises(EaglekitError, match=match):
        tiny_dspark(**bad)


def test_the_config_round_trips_and_counts_its_drafts() -> None:
    config = tiny_dspark(confidence_temperatures=(1.5, 2.0)).config
    assert DSparkConfig.from_dict(config.to_dict()) == config and config.drafter_type == "dspark"
    assert (config.max_drafts, config.first_slot) == (4, 0)
    fill_in = tiny_dspark(sample_from_anchor=False).config
    assert (fill_in.max_drafts, fill_in.first_slot) == (3, 1)
