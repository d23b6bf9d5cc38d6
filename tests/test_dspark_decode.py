"""DSpark decoding (`method=dspark`): greedy equals the target's own greedy output, sampling keeps the target's
distribution (also with confidence-based verification on), the Markov loop drafts what the model computes for the
drafts before it, the static fused step equals the eager one, and bad options are refused."""

from __future__ import annotations

import pytest
import torch

from builders import VOCAB, sampled_against_plain, tiny_target
from eaglekit.decode import Decoder
from eaglekit.decode.sampling import draft_probs_to_target, logits_to_probs
from eaglekit.drafters.dspark.decode import DSparkDrafterBackend, markov_chain
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.dspark.static import StaticDSparkDrafter
from eaglekit.errors import EaglekitError
from eaglekit.config.decode import DecodeOptions
from eaglekit.vllm.distribution import compare

PROMPTS = [[1, 5, 9, 12, 40, 41], [3, 3, 3], [7, 60, 2, 18, 18, 90, 4, 4, 11]]


def dspark_for(target: torch.nn.Module, block_size: int = 4, seed: int = 1, draft_vocab: int = 64,
               **heads) -> DSparkDrafter:
    """A random DSpark drafter for a `builders.tiny_target` (4 layers): context from layers 1 and 2, the target's
    embedding and lm_head rows, a Markov head whose bias is not zero (W2 random) and a confidence head."""
    torch.manual_seed(seed)
    config = target.config
    drafter = DSparkDrafter(DSparkConfig(
        hidden_size=config.hidden_size, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=config.hidden_size,
        target_layer_ids=(1, 2), mask_token_id=VOCAB - 1, block_size=block_size, target_num_layers=4,
        **{"markov_rank": 8, **heads}))
    if drafter.config.markov_rank:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    drafter.set_vocab_mapping(torch.arange(draft_vocab) + (VOCAB - draft_vocab) // 2)
    drafter.load_target_embedding(target.get_input_embeddings().weight.detach())
    drafter.load_target_lm_head(target.get_output_embeddings().weight.detach())
    return drafter.eval()


@pytest.mark.parametrize("heads", [{}, {"markov_head_type": "rnn"}, {"sample_from_anchor": False}])
def test_greedy_dspark_equals_plain(heads) -> None:
    target = tiny_target("llama")
    drafter = dspark_for(target, **heads)
    decoder = Decoder(target, drafter)
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, 20, method="plain")
        for chain_length in (1, drafter.config.max_drafts):  # a chain may be shorter than the block
            speculative = decoder.generate(prompt, 20, method="dspark", chain_length=chain_length)
            assert speculative.tokens == plain.tokens
            assert speculative.stats.max_drafts == chain_length
            assert len(speculative.stats.survival[0]) == chain_length  # the confidence of each draft's prefix
        topk = decoder.generate(prompt, 20, method="dspark", chain_length=drafter.config.max_drafts, draft_topk=3)
        assert topk.tokens == plain.tokens  # the Markov bias on 3 candidates: other drafts, the same output


def test_the_markov_loop_feeds_each_draft_to_the_next() -> None:
    """Greedy drafts of the loop = argmax of the model's own corrected logits given the drafts before it."""
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = dspark_for(target, markov_head_type="gated")
    backend = DSparkDrafterBackend(drafter)
    aux = torch.randn(7, 2 * target.config.hidden_size)
    with torch.no_grad():
        backend.extend(aux, torch.zeros(7, dtype=torch.long), torch.arange(7))
        hidden = backend.block_hidden(torch.tensor(17), 7, 4)  # (4, H)
        drafts, probs, confidences = markov_chain(drafter, hidden, torch.tensor(17), DecodeOptions(method="dspark"),
                                                  VOCAB, None)
        prev = torch.cat([torch.tensor([17]), drafts[:-1]])
        logits, e = drafter.markov_logits(hidden, prev)  # teacher-forced by the loop's own drafts
        assert torch.equal(drafts, drafter.draft_to_target(logits.argmax(-1)))
        torch.testing.assert_close(confidences, drafter.confidence_logits(hidden, e))
        assert probs is None
        context = drafter.context(aux[None], torch.arange(7)[None])
        ids = torch.tensor([[17, VOCAB - 1, VOCAB - 1, VOCAB - 1]])
        torch.testing.assert_close(hidden, drafter.hidden_states(ids, torch.arange(7, 11)[None], context)[0])


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_draft_topk_corrects_only_the_best_base_candidates(kind: str) -> None:
    """draft_topk = K: each draft is the best corrected logit among its position's K best base logits (the dense
    loop's own logits, teacher-forced by these drafts), also where the bias picks another candidate than the base
    logits would (the vanilla head's greedy table included); K = every draft id gives the dense loop's drafts."""
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = dspark_for(target, markov_head_type=kind)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=30.0)  # the bias decides between candidates
    backend = DSparkDrafterBackend(drafter)
    with torch.no_grad():
        backend.extend(torch.randn(7, 2 * target.config.hidden_size), torch.zeros(7, dtype=torch.long), torch.arange(7))
        hidden = backend.block_hidden(torch.tensor(17), 7, 4)  # (4, H)
        drafts, _, _ = markov_chain(drafter, hidden, torch.tensor(17), DecodeOptions(method="dspark", draft_topk=3),
                                    VOCAB, None)
        prev = torch.cat([torch.tensor([17]), drafts[:-1]])
        logits, _ = drafter.markov_logits(hidden, prev)  # (4, Vd) every draft id corrected
        candidates = drafter.lm_head(hidden).topk(3, dim=-1).indices  # (4, 3)
        best = candidates.gather(1, logits.gather(1, candidates).argmax(-1, keepdim=True))[:, 0]
        assert torch.equal(drafts, drafter.draft_to_target(best))
        assert not torch.equal(best, candidates[:, 0])  # the bias changed a draft
        all_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
        sampled_options = DecodeOptions(method="dspark", draft_topk=3, temperature=40.0, top_k=2)  # not one-hot
        others = 0  # drafts before the last that are not their position's first candidate
        for seed in range(4):
            sampled, probs, _ = markov_chain(drafter, hidden, torch.tensor(17), sampled_options, VOCAB,
                                             torch.Generator().manual_seed(seed))
            logits, _ = drafter.markov_logits(hidden, torch.cat([torch.tensor([17]), sampled[:-1]]))
            truncated = torch.full_like(logits, float("-inf")).scatter(-1, candidates, logits.gather(1, candidates))
            expected = logits_to_probs(truncated, 40.0, top_k=2)  # (4, Vd) what each draft was drawn from
            torch.testing.assert_close(probs, draft_probs_to_target(expected, all_ids, VOCAB))
            assert probs[torch.arange(4), sampled].min() > 0
            others += int((sampled[:-1] != all_ids[candidates[:-1, 0]]).sum())
        assert others  # the rows drawn from follow the drafts before them, not one fixed previous token
        every = DecodeOptions(method="dspark", draft_topk=drafter.config.draft_vocab_size)
        dense = markov_chain(drafter, hidden, torch.tensor(17), DecodeOptions(method="dspark"), VOCAB, None)[0]
        assert torch.equal(markov_chain(drafter, hidden, torch.tensor(17), every, VOCAB, None)[0], dense)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_fused_steps_equal_eager_ones(temperature: float) -> None:
    """The static DSpark backend in the fused step (the Markov loop inside it): the eager reference's tokens and
    acceptance, greedy and sampled (same seed), with and without a confidence cut."""
    target = tiny_target("llama")
    drafter = dspark_for(target, draft_vocab=VOCAB)
    if temperature > 0:
        with torch.no_grad():
            target.model.norm.weight.zero_()  # the target samples uniformly: deep drafts get accepted
    static = Decoder(target, drafter, backend="static", max_length=64)
    deepest = 0
    for threshold, draft_topk in ((0.0, 0), (0.3, 0), (0.0, 5)):
        for prompt in PROMPTS:
            options = dict(method="dspark", chain_length=4, temperature=temperature, seed=5,
                           verify_threshold=threshold, draft_topk=draft_topk)
            eager = Decoder(target, drafter).generate(prompt, 16, **options)
            fast = static.generate(prompt, 16, **options)
            assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
            assert fast.stats.verified == eager.stats.verified  # the drafts each step verified (none: a cut-less run)
            deepest = max(deepest, *fast.stats.accepted)
    assert deepest >= (2 if temperature > 0 else 0)
    assert isinstance(next(iter(static._drafters.values())), StaticDSparkDrafter)


@pytest.mark.parametrize("draft_topk, temperature", [(0, 0.0), (5, 0.0), (5, 1.0)])
def test_compiled_fused_dspark_step_is_one_graph(monkeypatch, draft_topk: int, temperature: float) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": "aot_eager", "fullgraph": True, "dynamic": None})
    target = tiny_target("llama")
    drafter = dspark_for(target)
    options = dict(method="dspark", chain_length=3, verify_threshold=0.2, draft_topk=draft_topk,
                   temperature=temperature, seed=5)
    fast = Decoder(target, drafter, backend="static", compile=True, max_length=128).generate(PROMPTS[0], 16, **options)
    eager = Decoder(target, drafter).generate(PROMPTS[0], 16, **options)
    assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
    assert counter.frame_count == 1


@pytest.mark.parametrize("threshold, draft_topk", [(0.0, 0), (0.4, 0), (0.0, 16)])
def test_sampled_dspark_keeps_the_targets_distribution(threshold: float, draft_topk: int) -> None:
    """The first three tokens of many T=1 samples with and without the drafter: the same distribution, while drafts
    do get accepted; with a confidence cut too (which drafts are verified depends on the drafts alone), and with the
    Markov bias on 16 candidates (the drafts drawn from that truncated distribution)."""
    target = tiny_target("llama")
    drafter = dspark_for(target, draft_vocab=VOCAB)
    if threshold:  # a calibration that makes the cut bite: confidences well under 1
        drafter.with_temperatures((4.0, 4.0))
    decoder = Decoder(target, drafter)
    plain, speculative, accepted = sampled_against_plain(decoder, PROMPTS, "dspark", 100, verify_threshold=threshold,
                                                         draft_topk=draft_topk)
    assert accepted > 20
    assert compare(plain, speculative)["matches_plain"]


def test_a_confidence_cut_verifies_fewer_drafts_and_keeps_greedy_output() -> None:
    target = tiny_target("llama")
    drafter = dspark_for(target)
    decoder = Decoder(target, drafter)
    for prompt in PROMPTS:
        plain = decoder.generate(prompt, 16, method="plain")
        full = decoder.generate(prompt, 16, method="dspark", chain_length=4)
        cut = decoder.generate(prompt, 16, method="dspark", chain_length=4, verify_threshold=0.5)
        assert cut.tokens == plain.tokens
        assert not full.stats.verified and len(cut.stats.verified) == len(cut.stats.accepted)
        survival = [[s >= 0.5 for s in step] for step in cut.stats.survival]
        assert cut.stats.verified == [sum(step) for step in survival]  # the leading drafts that pass, a prefix
        assert all(a <= v for a, v in zip(cut.stats.accepted, cut.stats.verified))


def test_bad_options_are_refused() -> None:
    target = tiny_target("llama")
    decoder = Decoder(target, dspark_for(target, block_size=4))
    with pytest.raises(EaglekitError, match="at most 4 drafts"):
        decoder.generate(PROMPTS[0], 8, method="dspark", chain_length=5)
    with pytest.raises(EaglekitError, match=r"verify_threshold=1.5: a survival probability, in \[0, 1\]"):
        decoder.generate(PROMPTS[0], 8, method="dspark", verify_threshold=1.5)
    with pytest.raises(EaglekitError, match="method=chain needs a drafter of type"):
        decoder.generate(PROMPTS[0], 8, method="chain")
    no_head = Decoder(target, dspark_for(target, confidence_head=False, confidence_head_with_markov=False))
    with pytest.raises(EaglekitError, match="needs the drafter's confidence head"):
        no_head.generate(PROMPTS[0], 8, method="dspark", chain_length=3, verify_threshold=0.5)
    from test_dflash_decode import dflash_for

    with pytest.raises(EaglekitError, match="method=dspark needs a drafter of type dspark"):
        Decoder(target, dflash_for(target)).generate(PROMPTS[0], 8, method="dspark")
    with pytest.raises(EaglekitError, match="draft_topk=65: this DSpark drafter has 64 draft ids"):
        decoder.generate(PROMPTS[0], 8, method="dspark", draft_topk=65)
    with pytest.raises(EaglekitError, match="draft_topk=-1: the number of Markov candidates"):
        decoder.generate(PROMPTS[0], 8, method="dspark", draft_topk=-1)
    with pytest.raises(EaglekitError, match="draft_topk=4 picks the candidates of a Markov head's correction"):
        Decoder(target, dflash_for(target)).generate(PROMPTS[0], 8, method="dflash", chain_length=3, draft_topk=4)
    with pytest.raises(EaglekitError, match="method=plain has none of"):
        decoder.generate(PROMPTS[0], 8, method="plain", draft_topk=4)
    with pytest.raises(EaglekitError, match="verify_threshold=0.5 cuts a chain"):
        Decoder(target, dflash_for(target)).generate(PROMPTS[0], 8, method="dflash", chain_length=3,
                                                     verify_threshold=0.5)
