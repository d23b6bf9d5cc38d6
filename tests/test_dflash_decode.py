"""DFlash decoding (`method=dflash`): greedy equals the target's own greedy output, sampling keeps the target's
distribution, the block is drafted as the one-block-at-a-time reference drafts it, and bad options are refused."""

from __future__ import annotations

import pytest
import torch

from builders import VOCAB, sampled_against_plain, tiny_target
from eaglekit.decode import Decoder
from eaglekit.drafters.dflash.decode import DFlashDrafterBackend
from eaglekit.drafters.dflash.static import StaticDFlashDrafter
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError
from eaglekit.vllm.distribution import compare


def dflash_for(target: torch.nn.Module, block_size: int = 4, seed: int = 1,
               draft_vocab: int = 64) -> DFlashDrafter:
    """A random DFlash drafter for a `builders.tiny_target` (4 layers): context from layers 1 and 2 (output-of-layer),
    the target's embedding and lm_head rows, so its drafts are the target-like guesses acceptance needs."""
    torch.manual_seed(seed)
    config = target.config
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=config.hidden_size, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=config.hidden_size,
        target_layer_ids=(1, 2), mask_token_id=VOCAB - 1, block_size=block_size, target_num_layers=4))
    drafter.set_vocab_mapping(torch.arange(draft_vocab) + (VOCAB - draft_vocab) // 2)
    drafter.load_target_embedding(target.get_input_embeddings().weight.detach())
    drafter.load_target_lm_head(target.get_output_embeddings().weight.detach())
    return drafter.eval()


PROMPTS = [[1, 5, 9, 12, 40, 41], [3, 3, 3], [7, 60, 2, 18, 18, 90, 4, 4, 11]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_dflash_equals_plain(kind: str) -> None:
    target = tiny_target(kind)
    decoder = Decoder(target, dflash_for(target))
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, 20, method="plain")
        for chain_length in (1, 3):
            speculative = decoder.generate(prompt, 20, method="dflash", chain_length=chain_length)
            assert speculative.tokens == plain.tokens
            assert speculative.stats.max_drafts == chain_length
            assert speculative.stats.target_forwards <= 20  # every step emits at least its bonus token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_fused_steps_equal_eager_ones(temperature: float) -> None:
    """The static DFlash backend in the fused step: the eager reference's tokens and acceptance, greedy and sampled
    (same seed), over several prompts reusing the same buffers (stale context slots stay masked). At T=1 the target's
    final norm is zeroed (it samples uniformly), so drafts deep in the block get accepted."""
    target = tiny_target("llama")
    drafter = dflash_for(target, draft_vocab=VOCAB)
    if temperature > 0:
        with torch.no_grad():
            target.model.norm.weight.zero_()
    static = Decoder(target, drafter, backend="static", max_length=64)
    deepest = 0
    for prompt in PROMPTS:
        options = dict(method="dflash", chain_length=3, temperature=temperature, seed=5)
        eager = Decoder(target, drafter).generate(prompt, 16, **options)
        fast = static.generate(prompt, 16, **options)
        assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
        deepest = max(deepest, *fast.stats.accepted)
    assert deepest >= (2 if temperature > 0 else 0)
    assert isinstance(next(iter(static._drafters.values())), StaticDFlashDrafter)


def test_static_block_equals_the_reference_block() -> None:
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = dflash_for(target)
    reference, static = DFlashDrafterBackend(drafter), StaticDFlashDrafter(drafter, 32, 3)
    aux = torch.randn(9, 2 * target.config.hidden_size)
    with torch.no_grad():
        for backend in (reference, static):
            backend.extend(aux[:5], torch.zeros(5, dtype=torch.long), torch.arange(5))
            backend.extend(aux[5:], torch.zeros(4, dtype=torch.long), torch.arange(5, 9))
        torch.testing.assert_close(static.block_logits(torch.tensor(17), 9, 3),
                                   reference.block_logits(torch.tensor(17), 9, 3))


def test_compiled_fused_dflash_step_is_one_graph(monkeypatch) -> None:
    """With compile=True the whole DFlash step (block, verify, verification, compaction, context write) traces as
    one graph (dynamo, aot_eager on the CPU) and gives the eager reference's tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": "aot_eager", "fullgraph": True, "dynamic": None})
    target = tiny_target("llama")
    drafter = dflash_for(target)
    options = dict(method="dflash", chain_length=3)
    fast = Decoder(target, drafter, backend="static", compile=True, max_length=128).generate(PROMPTS[0], 16, **options)
    eager = Decoder(target, drafter).generate(PROMPTS[0], 16, **options)
    assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
    assert counter.frame_count == 1


def test_block_drafts_are_the_reference_forward_over_the_whole_context() -> None:
    """The backend's context grows step by step; its block logits equal one drafter call over all of it."""
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = dflash_for(target)
    backend = DFlashDrafterBackend(drafter)
    aux = torch.randn(9, 2 * target.config.hidden_size)
    backend.extend(aux[:5], torch.zeros(5, dtype=torch.long), torch.arange(5))
    backend.extend(aux[5:], torch.zeros(4, dtype=torch.long), torch.arange(5, 9))
    got = backend.block_logits(torch.tensor(17), 9, 3)  # (3, Vd)
    context = drafter.context(aux[None], torch.arange(9)[None])
    ids = torch.tensor([[17, VOCAB - 1, VOCAB - 1, VOCAB - 1]])
    expected = drafter(ids, torch.arange(9, 13)[None], context)[0, 1:]
    torch.testing.assert_close(got, expected)


def test_sampled_dflash_keeps_the_targets_distribution() -> None:
    """The first three tokens of many T=1 samples with and without the drafter: the same distribution (the
    chain's p/q rule with each draft's own q), while drafts do get accepted (the rule is exercised)."""
    target = tiny_target("llama")
    decoder = Decoder(target, dflash_for(target, draft_vocab=VOCAB))
    plain, speculative, accepted = sampled_against_plain(decoder, PROMPTS, "dflash", 100)
    assert accepted > 30
    assert compare(plain, speculative)["matches_plain"]


def test_more_drafts_than_the_block_holds_are_refused() -> None:
    target = tiny_target("llama")
    decoder = Decoder(target, dflash_for(target, block_size=4))
    with pytest.raises(EaglekitError, match="block_size 4: at most 3"):
        decoder.generate(PROMPTS[0], 8, method="dflash", chain_length=4)
    with pytest.raises(EaglekitError, match="method=chain needs a drafter of type"):
        decoder.generate(PROMPTS[0], 8, method="chain")
