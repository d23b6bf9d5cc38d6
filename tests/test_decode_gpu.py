"""On a CUDA machine only (skipped elsewhere; run it first on a new GPU host): the compiled fast path with
the real backend (inductor + CUDA graphs, the fused greedy step queued a step ahead) gives the same tokens
as the eager reference, for plain decoding, greedy chains and trees, and sampled chains and trees."""

from __future__ import annotations

import pytest
import torch

from builders import random_drafter, tiny_target
from test_decode_engine import NEW, PROMPT, always_right_pair
from eaglekit.decode import Decoder, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LONG_PROMPT = [(7 * i) % 40 + 1 for i in range(70)]
CASES = [
    dict(method="plain"),
    dict(method="tree", depth=3, tree_top_k=3, total_tokens=8),
    dict(method="chain", chain_length=3),
    dict(method="tree", depth=3, tree_top_k=3, total_tokens=8, temperature=1.0, seed=3),
    dict(method="chain", chain_length=3, temperature=1.0, seed=3),
]


def test_compiled_cuda_fast_path_equals_eager():
    torch._dynamo.reset()
    target = tiny_target("llama").cuda()
    drafter = random_drafter(target).cuda()
    decoder = Decoder(target, drafter, backend="static", compile=True, max_length=128)
    for options in CASES:
        reference = generate(target, drafter, PROMPT, NEW, backend="eager", **options)
        # a second prompt length replays the same graphs (prefills: the same bucket); a 70-token prompt records
        # the prefills' second bucket (128 tokens, the whole cache)
        for prompt in (PROMPT, PROMPT[:3], LONG_PROMPT):
            fast = decoder.generate(prompt, NEW, **options)
            expected = reference if prompt is PROMPT else generate(target, drafter, prompt, NEW, backend="eager", **options)
            assert fast.tokens == expected.tokens, (options, len(prompt))
            assert fast.stats.accepted == expected.stats.accepted, (options, len(prompt))


def test_compiled_cuda_fused_step_full_acceptance_fits_the_tightest_cache():
    target, drafter = always_right_pair()
    target, drafter = target.cuda(), drafter.cuda()
    new = 14
    for method in ("tree", "chain"):
        decoder = Decoder(target, drafter, backend="static", compile=True, max_length=len(PROMPT) + new + 3 + 2)
        result = decoder.generate(PROMPT, new, method=method, depth=3, tree_top_k=1, total_tokens=3, chain_length=3)
        assert result.tokens == [0] * new and result.stats.accepted == [3] * 4, method


def test_compiled_cuda_parallel_and_dflash_steps_equal_eager():
    """P-EAGLE (the chain's mask slots drafted in the extend forward) and DFlash (the block over static context
    buffers) compiled into their fused steps: the eager reference's tokens and acceptance, greedy and sampled. The
    second target samples uniformly (final norm zeroed), so drafts deep in the chain or block get accepted."""
    from test_dflash_decode import dflash_for
    from test_parallel_drafting import p_eagle

    torch._dynamo.reset()
    target, uniform = tiny_target("llama"), tiny_target("llama")
    with torch.no_grad():
        uniform.model.norm.weight.zero_()
    for method, make in (("parallel", p_eagle), ("dflash", dflash_for)):
        drafter = make(target).cuda()
        for model, temperature in ((target, 0.0), (target, 1.0), (uniform, 1.0)):
            model = model.cuda()
            decoder = Decoder(model, drafter, backend="static", compile=True, max_length=128)
            for prompt in (PROMPT, LONG_PROMPT):
                options = dict(method=method, chain_length=3, temperature=temperature, seed=3)
                expected = generate(model, drafter, prompt, NEW, backend="eager", **options)
                fast = decoder.generate(prompt, NEW, **options)
                assert (fast.tokens, fast.stats.accepted) == (expected.tokens, expected.stats.accepted), (method, temperature)


def test_compiled_cuda_dspark_step_equals_eager():
    """DSpark (DFlash's static block, the Markov loop inside the fused step, a confidence cut, Markov candidates)
    compiled into its fused step: the eager reference's tokens, acceptance and drafts verified, greedy and sampled,
    cut or not, on every draft id or on 8 candidates."""
    from test_dspark_decode import dspark_for

    torch._dynamo.reset()
    target, uniform = tiny_target("llama"), tiny_target("llama")
    with torch.no_grad():
        uniform.model.norm.weight.zero_()
    drafter = dspark_for(target).cuda()
    for model, temperature in ((target, 0.0), (target, 1.0), (uniform, 1.0)):
        model = model.cuda()
        decoder = Decoder(model, drafter, backend="static", compile=True, max_length=128)
        for threshold, draft_topk in ((0.0, 0), (0.3, 0), (0.0, 8)):
            for prompt in (PROMPT, LONG_PROMPT):
                options = dict(method="dspark", chain_length=4, temperature=temperature, seed=3,
                               verify_threshold=threshold, draft_topk=draft_topk)
                expected = generate(model, drafter, prompt, NEW, backend="eager", **options)
                fast = decoder.generate(prompt, NEW, **options)
                assert (fast.tokens, fast.stats.accepted, fast.stats.verified) == (
                    expected.tokens, expected.stats.accepted, expected.stats.verified), (temperature, threshold,
                                                                                         draft_topk)
