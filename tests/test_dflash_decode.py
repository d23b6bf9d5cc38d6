"""DFlash decoding (`method=dflash`): greedy equals the target's own greedy output, sampling keeps the target's
distribution, the block is drafted as the one-block-at-a-time reference drafts it, and bad options are refused."""

from __future__ import annotations

import pytest
import torch

from builders import VOCAB, sampled_against_plain, tiny_target
from eaglekit.decode import Decoder
from eaglekit.decode.dflash import DFlashDrafterBackend
from eaglekit.draft.dflash import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError
from eaglekit.interop.distribution import compare


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


def test_static_target_backend_drafts_the_same() -> None:
    target = tiny_target("llama")
    drafter = dflash_for(target)
    eager = Decoder(target, drafter).generate(PROMPTS[0], 16, method="dflash", chain_length=3)
    static = Decoder(target, drafter, backend="static", max_length=64).generate(PROMPTS[0], 16, method="dflash",
                                                                                 chain_length=3)
    assert static.tokens == eager.tokens and static.stats.accepted == eager.stats.accepted


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
