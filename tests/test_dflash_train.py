"""DFlash training: anchors, the block attention mask, labels, and the batched block forward against the naive
one-block-at-a-time reference (the drafting call decoding makes)."""

from __future__ import annotations

import pytest
import torch

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.train import (
    block_attention_mask,
    block_forward,
    block_input_ids,
    block_labels,
    block_masks,
    block_positions,
    naive_block_forward,
    sample_anchors,
)
from eaglekit.training.objective import soft_labels


def tiny_dflash(seed: int = 0, vocab: int = 40, draft_vocab: int = 24, block_size: int = 4,
                layers: int = 2) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=layers, vocab_size=vocab, draft_vocab_size=draft_vocab,
                          target_hidden_size=16, target_layer_ids=(1, 3), mask_token_id=vocab - 1,
                          block_size=block_size, target_num_layers=6)
    drafter = DFlashDrafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    drafter.set_vocab_mapping(torch.sort(torch.randperm(vocab)[:draft_vocab]).values)
    return drafter


def test_block_mask_golden() -> None:
    mask = block_attention_mask(torch.tensor([[2, 0]]), seq_len=3, block_size=2)[0, 0].int()
    expected = torch.tensor([  # context t=0..2, then the two blocks' keys
        [1, 1, 0, 1, 1, 0, 0],
        [1, 1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(mask, expected)


def test_block_inputs_and_labels_golden() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    anchors = torch.tensor([[1, 3]])
    assert block_input_ids(ids, anchors, 3, 99).tolist() == [[11, 99, 99, 13, 99, 99]]
    assert block_positions(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5]]
    probs = torch.eye(5)[None]  # label of L_t is one-hot t
    loss_mask = torch.tensor([[False, True, True, False, True]])
    in_vocab = torch.tensor([[True, True, False, True, True]])
    labels = block_labels(probs, anchors, 3)
    train, accuracy = block_masks(loss_mask, in_vocab, anchors, torch.tensor([[True, True]]), 3)
    assert labels.argmax(-1).tolist() == [[[1, 2], [3, 4]]]  # position k of anchor a reads L_{a+k}
    # block 1 (a=1) drafts x2 (assistant, L1 in vocab), x3 (not assistant); block 2 (a=3) drafts x4, then past the end
    assert accuracy.permute(1, 2, 0).tolist() == [[[True, False], [True, False]]]
    assert train.permute(1, 2, 0).tolist() == [[[True, False], [True, False]]]


def test_sample_anchors_are_eligible_distinct_and_padded() -> None:
    loss_mask = torch.tensor([[False, False, True, True, True, False], [False, False, False, False, False, True]])
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 4)
    assert valid.sum(1).tolist() == [3, 1]  # row 0: a in {1, 2, 3}; row 1: a = 4
    assert sorted(anchors[0, :3].tolist()) == [1, 2, 3] and anchors[1, 0] == 4
    again, _ = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)


@pytest.mark.parametrize("block_size", [2, 4])
def test_block_forward_matches_naive_reference(block_size: int) -> None:
    drafter = tiny_dflash(block_size=block_size)
    b, t, v = 2, 11, drafter.config.vocab_size
    ids = torch.randint(0, v - 1, (b, t))
    loss_mask = torch.rand(b, t) > 0.3
    loss_mask[1, -3:] = False  # right padding
    aux = torch.randn(b, t, 2 * drafter.config.target_hidden_size)
    probs, in_vocab = soft_labels(torch.randn(b, t, v) * 3, drafter.t2d)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(1))
    fast = block_forward(drafter, aux, ids, loss_mask, probs, in_vocab, anchors, valid, 0.9)
    naive = naive_block_forward(drafter, aux, ids, loss_mask, probs, in_vocab, anchors, valid, 0.9)
    assert fast.train_counts.sum() > 0
    torch.testing.assert_close(fast.loss, naive.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.loss_sums, naive.loss_sums, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.correct, naive.correct)
    assert torch.equal(fast.train_counts, naive.train_counts)
    assert torch.equal(fast.accuracy_counts, naive.accuracy_counts)
    fast.loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_flex_block_mask_gives_the_boolean_masks_loss() -> None:
    """attention=flex (the block mask, compiled on CUDA) equals SDPA with the boolean mask (forward: the CPU has no
    flex backward)."""
    drafter = tiny_dflash(block_size=4)
    b, t, v = 2, 11, drafter.config.vocab_size
    ids = torch.randint(0, v - 1, (b, t))
    loss_mask = torch.rand(b, t) > 0.3
    aux = torch.randn(b, t, 2 * drafter.config.target_hidden_size)
    probs, in_vocab = soft_labels(torch.randn(b, t, v) * 3, drafter.t2d)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = block_forward(drafter, aux, ids, loss_mask, probs, in_vocab, anchors, valid, 0.9)
        flex = block_forward(drafter, aux, ids, loss_mask, probs, in_vocab, anchors, valid, 0.9, attention="flex")
    torch.testing.assert_close(flex.loss_sums, dense.loss_sums, rtol=1e-5, atol=1e-5)
    assert torch.equal(flex.correct, dense.correct)
