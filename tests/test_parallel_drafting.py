"""P-EAGLE (parallel drafting): the training loss equals the decode-time reference at every anchor, the decoder
drafts what that reference drafts, greedy output equals plain on the eager and static backends (an oracle drafter
gets every draft accepted), T = 1 keeps the target's distribution, and the drafter type travels with the
checkpoint."""

from __future__ import annotations

import pytest
import torch

from builders import VOCAB, OracleDrafter, random_drafter, sampled_against_plain, tiny_target
from eaglekit.decode import Decoder
from eaglekit.drafters.eagle3.decode import EagerDrafter
from eaglekit.drafters.p_eagle.decode import parallel_logits
from eaglekit.formats.saved import load_saved_drafter, saved_drafter_type
from eaglekit.drafters.p_eagle.train import anchor_logits, naive_parallel_forward, parallel_forward, to_parallel
from eaglekit.errors import EaglekitError
from eaglekit.vllm.distribution import compare

PROMPTS = ([5, 17, 33, 2, 9, 41], [7, 3, 60, 12])
MASK_TOKEN = VOCAB - 1


def p_eagle(target, seed: int = 1, **variant):
    drafter = random_drafter(target, seed)
    if variant:
        from dataclasses import replace

        from eaglekit.drafters.eagle3.model import Eagle3Drafter

        plain = drafter
        drafter = Eagle3Drafter(replace(plain.config, **variant))
        drafter.load_state_dict(plain.state_dict(), strict=False)
    return to_parallel(drafter, MASK_TOKEN, seed).eval()


def batch(seed: int, b: int = 2, t: int = 9, vd: int = 64, h: int = 32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, 3 * h, generator=g), torch.randint(0, VOCAB, (b, t), generator=g),
            torch.rand(b, t, generator=g) > 0.3, torch.softmax(torch.randn(b, t, vd, generator=g), -1),
            torch.rand(b, t, generator=g) > 0.2)


@pytest.mark.parametrize("variant", [{}, {"norm_before_fc": True}])
def test_parallel_loss_equals_the_decode_time_reference(variant) -> None:
    drafter = p_eagle(tiny_target("llama"), **variant).train()
    aux, ids, loss_mask, probs, in_vocab = batch(0)
    fast = parallel_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=4)
    naive = naive_parallel_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=4)
    for name in ("loss_sums", "correct", "train_counts", "accuracy_counts"):
        torch.testing.assert_close(getattr(fast, name), getattr(naive, name), msg=name)
    assert fast.train_counts[3] > 0  # the last position is trained somewhere
    for parameter in (drafter.mask_hidden, drafter.fc.weight, drafter.midlayer.self_attn.q_proj.weight):
        torch.testing.assert_close(torch.autograd.grad(fast.loss, parameter, retain_graph=True)[0],
                                   torch.autograd.grad(naive.loss, parameter, retain_graph=True)[0])
    assert drafter.mask_hidden.grad is None and bool(torch.autograd.grad(fast.loss, drafter.mask_hidden)[0].any())


def test_decoder_drafts_what_the_reference_drafts() -> None:
    """extend (the accepted positions) then one draft step of k - 1 mask slots = one causal forward over the
    positions and the slots (what vLLM runs with parallel_drafting)."""
    target = tiny_target("llama")
    drafter = p_eagle(target)
    aux, ids = batch(1, b=1)[:2]
    backend = EagerDrafter(drafter)
    with torch.no_grad():
        backend.extend(aux[0, :5], ids[0, 1:6], torch.arange(5))
        _, root = backend.extend(aux[0, 5:8], ids[0, 6:9], torch.arange(5, 8))
        got = parallel_logits(backend, drafter, root[-1], 8, 4)  # (4, Vd)
        expected = anchor_logits(drafter, drafter.fuse(aux[0, :8]), ids[0, :9], 7, 4)
    torch.testing.assert_close(got, expected)


class ParallelOracle(OracleDrafter):
    """The oracle as a P-EAGLE drafter: at drafter position p it names sequence[p + 2], mask slot or not."""

    def __init__(self, sequence: list[int], num_layers: int):
        super().__init__(sequence, num_layers)
        self.config.drafter_type, self.config.mask_token_id = "p-eagle", MASK_TOKEN

    def mask_feature(self) -> torch.Tensor:
        return torch.zeros(1, 4)


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_parallel_greedy_equals_plain(backend) -> None:
    target = tiny_target("llama")
    for prompt in PROMPTS:
        plain = Decoder(target, None, backend).generate(prompt, 14, method="plain").tokens
        result = Decoder(target, p_eagle(target), backend).generate(prompt, 14, method="parallel", chain_length=3)
        assert result.tokens == plain
        oracle = ParallelOracle(prompt + plain, target.config.num_hidden_layers)
        full = Decoder(target, oracle, "eager").generate(prompt, 14, method="parallel", chain_length=3)
        assert full.tokens == plain
        assert all(a == 3 for a in full.stats.accepted[:-1]) and len(full.stats.accepted) >= 3


def test_static_parallel_steps_equal_eager_ones() -> None:
    """The fused step drafts a chain's mask slots in the previous step's extend forward: the eager reference's
    tokens and acceptance (T=0 and T=1, chains of 1 and 3, prompts reusing the static buffers). A target whose final
    norm is zeroed samples uniformly at T=1, so drafts at every chain position get accepted and the mask slots'
    distributions decide the tokens."""
    target, uniform = tiny_target("llama"), tiny_target("llama")
    with torch.no_grad():
        uniform.model.norm.weight.zero_()
    drafter = p_eagle(target)
    cases = [(target, prompt, 3, temperature) for prompt in PROMPTS for temperature in (0.0, 1.0)]
    cases += [(target, PROMPTS[0], 1, 0.0)] + [(uniform, prompt, 3, 1.0) for prompt in PROMPTS]
    deepest = 0
    for model, prompt, chain_length, temperature in cases:
        options = dict(method="parallel", chain_length=chain_length, temperature=temperature, seed=3)
        eager = Decoder(model, drafter).generate(prompt, 16, **options)
        fast = Decoder(model, drafter, "static", max_length=64).generate(prompt, 16, **options)
        assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
        deepest = max(deepest, *fast.stats.accepted)
    assert deepest == 3  # a mask slot's draft was accepted


def test_mask_slots_drafted_with_the_extend_equal_a_draft_step_after_it() -> None:
    from eaglekit.decode.graphs import GraphSteps
    from eaglekit.drafters.eagle3.static import StaticDrafter

    target = tiny_target("llama")
    drafter = p_eagle(target)
    aux, ids = batch(2, b=1)[:2]
    merged, separate = (StaticDrafter(drafter, 32, 3) for _ in range(2))
    with torch.no_grad():
        for backend in (merged, separate):
            backend.extend(aux[0, :5], ids[0, 1:6], torch.arange(5))
        stable, length = torch.tensor(5), torch.tensor(7)  # 3 rows written, the first 2 of them accepted
        _, logits = merged.extend_and_draft(aux[0, 5:8], ids[0, 6:9], torch.arange(5, 8), stable, length, 2)
        _, root = separate._extend(aux[0, 5:7], ids[0, 6:8], torch.arange(5, 7), stable)
        expected = parallel_logits(GraphSteps(separate, length), drafter, root[-1], length, 3)  # (3, Vd)
    torch.testing.assert_close(logits[1], expected[0])
    torch.testing.assert_close(logits[3:], expected[1:])


def test_compiled_parallel_step_is_one_graph(monkeypatch) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": "aot_eager", "fullgraph": True, "dynamic": None})
    target = tiny_target("llama")
    drafter = p_eagle(target)
    options = dict(method="parallel", chain_length=3)
    fast = Decoder(target, drafter, "static", compile=True, max_length=128).generate(PROMPTS[0], 16, **options)
    eager = Decoder(target, drafter).generate(PROMPTS[0], 16, **options)
    assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted)
    assert counter.frame_count == 1


def test_sampled_parallel_keeps_the_targets_distribution() -> None:
    target = tiny_target("llama")
    decoder = Decoder(target, p_eagle(target))
    plain, speculative, accepted = sampled_against_plain(decoder, PROMPTS, "parallel", 150)
    assert accepted > 20
    assert compare(plain, speculative)["matches_plain"]


def test_parallel_needs_a_p_eagle_drafter() -> None:
    target = tiny_target("llama")
    with pytest.raises(EaglekitError, match="method=parallel needs a drafter of type p-eagle"):
        Decoder(target, random_drafter(target)).generate(PROMPTS[0], 4, method="parallel")


def test_drafter_type_round_trip(tmp_path) -> None:
    target = tiny_target("llama")
    drafter = p_eagle(target)
    drafter.save_pretrained(tmp_path / "p")
    random_drafter(target).save_pretrained(tmp_path / "e")
    assert saved_drafter_type(tmp_path / "p") == "p-eagle" and saved_drafter_type(tmp_path / "e") == "eagle3"
    loaded = load_saved_drafter(tmp_path / "p")
    assert loaded.config.mask_token_id == MASK_TOKEN
    torch.testing.assert_close(loaded.mask_hidden, drafter.mask_hidden)
    assert to_parallel(loaded, -1, 0) is loaded
    with pytest.raises(EaglekitError, match="trained with"):
        to_parallel(loaded, 3, 0)
