"""TTT: golden masks and shifts, and the efficient K-step forward against the naive per-step reference."""

from __future__ import annotations

import pytest
import torch

from builders import both_ttt_paths
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import (
    naive_ttt_forward,
    reference_step,
    shift_left,
    step_masks,
    ttt_attention_mask,
    ttt_forward,
)
from eaglekit.training.objective import expected_acceptance, soft_labels, soft_labels_from_hidden, step_weights


def tiny_drafter(seed: int = 0, vocab: int = 40, draft_vocab: int = 24, kv_heads: int = 2) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
        vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=16, aux_layer_ids=(1, 2, 3), target_num_layers=8,
    )
    drafter = Eagle3Drafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    drafter.set_vocab_mapping(torch.sort(torch.randperm(vocab)[:draft_vocab]).values)
    return drafter


def batch(drafter: Eagle3Drafter, b: int = 2, t: int = 12):
    v = drafter.config.vocab_size
    ids = torch.randint(0, v, (b, t))
    loss_mask = torch.rand(b, t) > 0.3
    loss_mask[1, -2:] = False  # right padding of a shorter row
    aux = torch.randn(b, t, 3 * drafter.config.target_hidden_size)
    target_logits = torch.randn(b, t, v) * 3
    probs, in_vocab = soft_labels(target_logits, drafter.t2d)
    return aux, ids, loss_mask, probs, in_vocab, target_logits


def test_attention_mask_golden() -> None:
    mask = ttt_attention_mask(3, 2).int()
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ])
    assert torch.equal(mask, expected)
    assert torch.equal(ttt_attention_mask(3, 0).int(), torch.ones(3, 3, dtype=torch.int).tril())


def test_shift_and_masks_golden() -> None:
    x = torch.tensor([[1, 2, 3, 4, 5]])
    assert shift_left(x, 2, 0).tolist() == [[3, 4, 5, 0, 0]]
    assert shift_left(x, 9, 0).tolist() == [[0, 0, 0, 0, 0]]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    in_vocab = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    train, accuracy = step_masks(loss_mask, in_vocab, 2)
    # step 0 at t: predicted token m_{t+2}, label argmax of L_{t+1} in vocab
    assert accuracy[0].int().tolist() == [[1, 1, 1, 0, 0, 0]]
    assert train[0].int().tolist() == [[1, 0, 1, 0, 0, 0]]
    assert accuracy[1].int().tolist() == [[1, 1, 0, 0, 0, 0]]
    assert train[1].int().tolist() == [[0, 1, 0, 0, 0, 0]]
    assert torch.allclose(step_weights(3), torch.tensor([1.0, 0.8, 0.64]))
    assert expected_acceptance([0.5, 0.5]) == pytest.approx(1.75)


def test_mean_mask_counts_match_step_masks() -> None:
    """The per-step token counts step_weighting=tokens divides by are the mean sizes of step_masks' accuracy
    masks, for records of mixed lengths (some shorter than the steps, some cut by max_length)."""
    from eaglekit.training.data import mean_mask_counts, pad_stack

    generator = torch.Generator().manual_seed(0)
    tokens = [(torch.zeros(n, dtype=torch.long), (torch.rand(n, generator=generator) < 0.6).long()) for n in (1, 3, 9, 40, 75)]
    steps, max_length, indices = 5, 50, [4, 0, 2, 3, 1, 3]
    masks = pad_stack([tokens[i][1][:max_length].bool() for i in indices], max_length, False)
    expected = step_masks(masks, torch.ones_like(masks), steps)[1].sum(dim=(1, 2)).float() / len(indices)
    assert torch.equal(mean_mask_counts(tokens, indices, max_length, steps), expected)
    assert torch.equal(mean_mask_counts(tokens, [], max_length, steps), torch.zeros(steps))


def test_soft_labels_chunked_matches_full() -> None:
    torch.manual_seed(1)
    final, weight = torch.randn(2, 5, 8), torch.randn(30, 8)
    t2d = torch.zeros(30, dtype=torch.bool)
    t2d[::3] = True
    probs, in_vocab = soft_labels(final @ weight.T, t2d)
    probs2, in_vocab2 = soft_labels_from_hidden(final, weight, t2d, chunk_tokens=3)
    assert torch.allclose(probs, probs2, atol=1e-6) and torch.equal(in_vocab, in_vocab2)
    assert probs.shape == (2, 5, 10) and torch.allclose(probs.sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_efficient_ttt_matches_naive(kv_heads: int) -> None:
    drafter = tiny_drafter(kv_heads=kv_heads).double()
    aux, ids, loss_mask, probs, in_vocab, _ = batch(drafter)
    aux, probs = aux.double(), probs.double()
    fast, slow, fast_grads = both_ttt_paths(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=4)
    assert torch.allclose(fast.loss_sums, slow.loss_sums, rtol=1e-9, atol=1e-9)
    assert torch.equal(fast.correct, slow.correct) and torch.equal(fast.train_counts, slow.train_counts)
    assert torch.allclose(fast.loss, slow.loss, rtol=1e-10)
    for name, grad in fast_grads.items():
        assert torch.allclose(grad, dict(drafter.named_parameters())[name].grad, rtol=1e-9, atol=1e-12), name
    assert bool((fast.train_counts > 0).all()) and float(fast.loss) > 0


def test_reference_step_matches_module_forward() -> None:
    """The hand-written step equals `Eagle3Drafter.forward` (the path decoding and export use)."""
    drafter = tiny_drafter()
    hidden, ids = torch.randn(2, 6, 32), torch.randint(0, 40, (2, 6))
    pos = torch.arange(6).expand(2, 6) + 3
    out, logits, kv = drafter(hidden, ids, pos, None, torch.ones(6, 6, dtype=torch.bool).tril()[None, None])
    ref_out, ref_logits, ref_kv = reference_step(drafter, hidden, ids, pos, [])
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(logits, ref_logits, atol=1e-5)
    assert torch.allclose(kv[0], ref_kv[0], atol=1e-5) and torch.allclose(kv[1], ref_kv[1], atol=1e-5)


def test_flex_attention_matches_sdpa() -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    drafter = tiny_drafter()
    aux, ids, loss_mask, probs, in_vocab, _ = batch(drafter, t=8)
    torch.set_grad_enabled(False)  # flex attention has no CPU backward; the GPU benchmark trains with it
    sdpa = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3, attention="sdpa")
    flex = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3, attention="flex")
    torch.set_grad_enabled(True)
    assert torch.allclose(sdpa.loss_sums, flex.loss_sums, rtol=1e-4)


def test_compiled_ttt_module_matches_naive() -> None:
    """The torch.compile path (`compile=true`; aot_eager here: inductor on CPU takes ~90 s, checked by hand)."""
    from eaglekit.drafters.eagle3.ttt import TTTModule

    drafter = tiny_drafter()
    aux, ids, loss_mask, probs, in_vocab, _ = batch(drafter)
    compiled = torch.compile(TTTModule(drafter, 3, 0.8, "sdpa"), backend="aot_eager")
    loss, loss_sums, correct, *_ = compiled(aux, ids, loss_mask, probs, in_vocab, None)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    reference = naive_ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3)
    reference.loss.backward()
    assert torch.allclose(loss_sums, reference.loss_sums, rtol=1e-5) and torch.equal(correct, reference.correct)
    for name, grad in grads.items():
        assert torch.allclose(grad, dict(drafter.named_parameters())[name].grad, rtol=1e-4, atol=1e-6), name


def test_init_from_reads_other_formats_through_interop(tmp_path) -> None:
    """`train init_from=` accepts a vLLM/SGLang/speculators layout via eaglekit.doctor (same weights back)."""
    pytest.importorskip("eaglekit.drafters.eagle3.convert")
    from eaglekit.drafters.eagle3.convert import export_drafter
    from eaglekit.formats.saved import load_drafter

    drafter = tiny_drafter()
    export_drafter(drafter, tmp_path / "vllm", "vllm")
    loaded = load_drafter(str(tmp_path / "vllm"), target_num_layers=8)
    for name, tensor in drafter.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[name], tensor), name
