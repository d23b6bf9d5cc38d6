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
