"""Speculative decoding reproduces target greedy decoding token for token (HF `generate` is the
reference) for Llama, Qwen3-MoE and DeepSeek-V3 tiny targets, chains and trees, with a random drafter
(little accepted) and an oracle drafter (everything accepted), stopping on EOS mid-draft and at the
length limit; the static fast path equals the eager path."""

from __future__ import annotations

import copy
import itertools
import math
import shutil

import pytest
import torch

from builders import OracleDrafter, random_drafter, tiny_target
from eaglekit.decode import Decoder, generate
from eaglekit.errors import EaglekitError

PROMPT = [5, 17, 33, 2, 9, 41]
NEW = 16


def hf_greedy(target, max_new_tokens: int, eos: int | None = None) -> list[int]:
    out = target.generate(torch.tensor([PROMPT]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "deepseek_v3"])
def case(request):
    target = tiny_target(request.param)
    return request.param, target, hf_greedy(target, NEW)


@pytest.mark.parametrize("method", ["plain", "chain", "tree"])
def test_random_drafter_matches_hf_greedy(case, method):
    _, target, reference = case
    result = generate(target, random_drafter(target), PROMPT, NEW, method=method, depth=3, tree_top_k=3, total_tokens=8)
    assert result.tokens == reference
    assert result.finish_reason == "length"


@pytest.mark.parametrize("method,tau", [("chain", 4.0), ("tree", 4.0)])
def test_oracle_drafter_accepts_everything(case, method, tau):
    _, target, reference = case
    oracle = OracleDrafter(PROMPT + reference, target.config.num_hidden_layers)
    result = generate(target, oracle, PROMPT, NEW, method=method, chain_length=3, depth=3, tree_top_k=3, total_tokens=8)
    assert result.tokens == reference
    full_steps = result.stats.accepted[:-1]  # the last step may be cut by the length limit
    assert full_steps and all(a == 3 for a in full_steps)
    assert result.stats.acceptance_per_position()[:1] == [1.0]


def test_eos_mid_draft_and_length_limit(case):
    name, target, reference = case
    eos = reference[9]  # the 10th token falls inside a 4-token accepted block (steps emit 1, then 4, 4, ...)
    expected = hf_greedy(target, NEW, eos=eos)
    assert expected[-1] == eos and len(expected) <= 10
    oracle = OracleDrafter(PROMPT + reference, target.config.num_hidden_layers)
    for method in ("plain", "chain", "tree"):
        result = generate(target, oracle, PROMPT, NEW, method=method, chain_length=3, depth=3, tree_top_k=2,
                          total_tokens=6, eos_token_ids=(eos,))
        assert result.tokens == expected and result.finish_reason == "eos", (name, method)
        cut = generate(target, oracle, PROMPT, 7, method=method, chain_length=3, depth=3, tree_top_k=2, total_tokens=6)
        assert cut.tokens == reference[:7] and cut.finish_reason == "length"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_fast_path_equals_eager(kind):
    target = tiny_target(kind)
    drafter = random_drafter(target)
    reference = hf_greedy(target, NEW)
    for method in ("plain", "chain", "tree"):
        kwargs = dict(method=method, depth=3, tree_top_k=3, total_tokens=8)
        eager = generate(target, drafter, PROMPT, NEW, backend="eager", **kwargs)
        fast = generate(target, drafter, PROMPT, NEW, backend="static", **kwargs)
        assert fast.tokens == eager.tokens == reference
        assert fast.stats.accepted == eager.stats.accepted
    oracle = OracleDrafter(PROMPT + reference, target.config.num_hidden_layers)
    fast = generate(target, oracle, PROMPT, NEW, backend="static", method="tree", depth=3, tree_top_k=3, total_tokens=8)
    assert fast.tokens == reference  # every step compacts accepted KV entries inside the static cache
    decoder = Decoder(target, drafter, backend="static", max_length=128)  # caches reused across calls
    first = decoder.generate(PROMPT, NEW, method="tree", depth=3, tree_top_k=3, total_tokens=8)
    again = decoder.generate(PROMPT[:3], NEW, method="tree", depth=3, tree_top_k=3, total_tokens=8)
    assert first.tokens == reference
    assert again.tokens == generate(target, drafter, PROMPT[:3], NEW, method="tree", depth=3, tree_top_k=3, total_tokens=8).tokens


def test_static_fast_path_sampling_equals_eager():
    target = tiny_target("llama")
    drafter = random_drafter(target)
    for method in ("chain", "tree"):
        kwargs = dict(method=method, temperature=1.0, seed=3, depth=3, tree_top_k=3, total_tokens=8)
        eager = generate(target, drafter, PROMPT, 16, backend="eager", **kwargs)
        fast = generate(target, drafter, PROMPT, 16, backend="static", **kwargs)
        assert fast.tokens == eager.tokens


def test_fused_sampling_equals_eager_over_seeds(monkeypatch):
    """The fused step draws a sampled step's uniforms before each launch exactly as the reference loop draws
    them: the same tokens and acceptance for every seed, chains and trees, with top-k and top-p filtering too."""
    from eaglekit.decode import fused

    runs = []
    original = fused.FusedStep.run
    monkeypatch.setattr(fused.FusedStep, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    target = tiny_target("llama")
    drafter = random_drafter(target)
    for seed, method in itertools.product(range(3), ("tree", "chain")):
        kwargs = dict(method=method, temperature=1.0, top_k=20, top_p=0.9, seed=seed, depth=3, tree_top_k=3, total_tokens=8)
        eager = generate(target, drafter, PROMPT, NEW, backend="eager", **kwargs)
        fast = generate(target, drafter, PROMPT, NEW, backend="static", **kwargs)
        assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted), seed
    small = dict(method="tree", depth=1, tree_top_k=2, total_tokens=8, temperature=1.0, seed=5)  # pool of 2 < 8
    assert generate(target, drafter, PROMPT, NEW, backend="static", **small).tokens == generate(
        target, drafter, PROMPT, NEW, backend="eager", **small).tokens
    assert len(runs) == 7  # the static path took the fused step each time


def test_static_rejects_moe_and_bad_options():
    target = tiny_target("qwen3_moe")
    with pytest.raises(EaglekitError, match="backend=eager"):
        generate(target, None, PROMPT, 4, method="plain", backend="static")
    with pytest.raises(EaglekitError, match="needs a drafter"):
        generate(target, None, PROMPT, 4, method="tree")
    with pytest.raises(EaglekitError, match="unknown decode method"):
        generate(target, None, PROMPT, 4, method="beam")


def test_compiled_fast_path_is_whole_graphs_and_equals_eager(monkeypatch):
    """compile=True traced on the CPU (a frame-counting backend instead of inductor + CUDA graphs): the same
    tokens as the eager path, a whole greedy step is one graph, and decoding more steps adds no graphs."""
    from torch._dynamo.testing import CompileCounter

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    counter, prefills = CompileCounter(), CompileCounter()
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": prefills, "fullgraph": True, "dynamic": None})
    target = tiny_target("llama")
    drafter = random_drafter(target)
    reference = hf_greedy(target, NEW)
    oracle = OracleDrafter(PROMPT + reference, target.config.num_hidden_layers)
    tree = dict(method="tree", depth=3, tree_top_k=3, total_tokens=8)
    decoder = Decoder(target, drafter, backend="static", compile=True, max_length=128)
    assert decoder.generate(PROMPT, NEW, **tree).tokens == reference
    step_graphs = counter.frame_count
    assert step_graphs == 1  # greedy: the whole step (draft, verify, verification, KV compaction, extend) is one graph
    assert prefills.frame_count == 2  # the target's prefill and the drafter's
    assert decoder.generate(PROMPT[:4], 2 * NEW, **tree).tokens == generate(target, drafter, PROMPT[:4], 2 * NEW, **tree).tokens
    assert counter.frame_count == step_graphs  # positions and cache lengths are graph inputs, not constants
    assert prefills.frame_count == 2  # another prompt length: the prefills' length is symbolic
    for kwargs in (dict(method="chain", chain_length=3), dict(tree, temperature=1.0, seed=3), dict(method="chain", temperature=1.0, seed=3)):
        fast = decoder.generate(PROMPT, NEW, **kwargs)
        assert fast.tokens == generate(target, drafter, PROMPT, NEW, **kwargs).tokens, kwargs
    fast = Decoder(target, None, backend="static", compile=True, max_length=128).generate(PROMPT, NEW, method="plain")
    assert fast.tokens == reference
    assert generate(target, oracle, PROMPT, NEW, backend="static", compile=True, **tree).tokens == reference


def test_compiled_prefills_run_padded_to_their_bucket(monkeypatch):
    """compile=True pads both prefills up to a multiple of PREFILL_BUCKET, capped by the cache (here without
    dynamo, recording the lengths the prefill functions see): the padding rows change no token, for a prompt
    whose bucket fits and one whose bucket the cache cuts short."""
    from eaglekit.decode import graphs, static

    seen: list[int] = []

    def recording(fn, enabled):
        def call(*tensors):
            seen.append(tensors[0].shape[0])
            return fn(*tensors)
        return call if enabled else fn

    monkeypatch.setattr(graphs, "compiled", lambda fn, enabled: fn)
    monkeypatch.setattr(graphs, "prefill_compiled", recording)
    target = tiny_target("llama")
    drafter = random_drafter(target)
    prompt = [(7 * i) % 40 + 1 for i in range(70)]
    speculative = (dict(method="tree", depth=3, tree_top_k=3, total_tokens=8), dict(method="chain", chain_length=3))
    for max_length, options, padded in ((160, speculative[0], 128), (100, speculative[1], 100)):
        seen.clear()
        decoder = Decoder(target, drafter, backend="static", compile=True, max_length=max_length)
        for kwargs in (options, dict(method="plain")):
            assert decoder.generate(prompt, NEW, **kwargs).tokens == generate(target, drafter, prompt, NEW, backend="eager", **kwargs).tokens
        assert seen == [padded, padded, padded], max_length  # target and drafter, then target (plain)
    assert static._bucket(1, 500) == static.PREFILL_BUCKET and static._bucket(300, 280) == 300


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_prefill_logits_for_the_last_token_only(kind):
    """Decoding's prefill asks for the last token's logits only (`last_only`): the static backend runs the lm_head on
    that row, HF models get logits_to_keep=1; both equal the last row of a full forward."""
    from eaglekit.decode.backends import HFTarget
    from eaglekit.decode.static import StaticTarget

    target = tiny_target(kind)
    n = len(PROMPT)
    ids, positions, mask = torch.tensor(PROMPT), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    reference = target(ids[None]).logits[0]  # (n, V)
    assert HFTarget(target, None).keeps_logits  # transformers' models take logits_to_keep
    backends = [lambda: HFTarget(target, None)] + ([lambda: StaticTarget(target, 64, None)] if kind == "llama" else [])
    with torch.inference_mode():
        for make in backends:
            full, _ = make().forward(ids, positions, mask)
            last, _ = make().forward(ids, positions, mask, last_only=True)
            assert full.shape == reference.shape and last.shape == (1, reference.shape[1])
            assert torch.allclose(full, reference, atol=1e-4) and torch.allclose(last[0], reference[-1], atol=1e-4)


def always_right_pair():
    """A real target and a real EAGLE-3 drafter (so the static fused path runs) that always agree: the target's
    final norm is zero, so its logits are all 0 and greedy picks id 0; every draft id maps to target id 0."""
    target = copy.deepcopy(tiny_target("llama"))
    drafter = random_drafter(target)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        drafter.d2t.copy_(-torch.arange(drafter.d2t.numel()))  # offsets: draft id i -> target id 0
    return target, drafter


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU backend needs a C++ compiler")
def test_fused_step_lowers_through_inductor(monkeypatch):
    """The fused step through inductor itself (CPU code generation here; on a GPU the same graph becomes
    Triton kernels in a CUDA graph): every op lowers, the tokens equal the eager reference, and the KV
    writes, the compaction of the accepted path and the drafter's cache writes stay in place (no
    allocation as large as a cache)."""
    from torch._inductor.utils import run_and_get_code

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": "inductor", "fullgraph": True, "dynamic": False})
    target = tiny_target("llama")
    drafter = random_drafter(target)
    decoder = Decoder(target, drafter, backend="static", compile=True, max_length=128)
    # the p/q rule with drawn uniforms; sampled children (the greedy tree's graph differs from the sampled one only in
    # its acceptance rule, which the static backend's own tests compare with the eager one)
    for options in (dict(method="chain", chain_length=3, temperature=1.0, seed=3),
                    dict(method="tree", depth=3, tree_top_k=3, total_tokens=8, temperature=1.0, seed=3)):
        fast, code = run_and_get_code(lambda: decoder.generate(PROMPT, NEW, **options))
        eager = generate(target, drafter, PROMPT, NEW, backend="eager", **options)
        assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted), options
        cache = next(iter(decoder._targets.values())).net.caches(0)[0]
        shapes = _allocations("".join(code))
        assert shapes and max(math.prod(shape) for shape in shapes) < cache.numel(), (options, shapes)


def _allocations(code: str) -> list[tuple[int, ...]]:
    """Shapes of the buffers inductor's generated CPU code allocates."""
    import re

    return [tuple(int(x) for x in m.split(",") if x.strip()) for m in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_writes_the_kv_cache_in_place():
    """The compiled target step allocates nothing as large as a KV cache: K/V are written into the cache
    buffers in place (a write through a view of one all-layer buffer once made inductor copy all of it per layer)."""
    from torch._inductor.utils import run_and_get_code

    from eaglekit.decode.static import StaticTarget

    torch._dynamo.reset()
    static = StaticTarget(tiny_target("llama"), 256, (1, 2, 3))
    cache = static.net.caches(0)[0]  # (1, nkv, S, D)
    step = torch.compile(static.net, backend="inductor", fullgraph=True, dynamic=False)
    ids, positions = torch.tensor([3, 4]), torch.tensor([5, 6])
    with torch.inference_mode():
        _, code = run_and_get_code(step, ids, positions, positions, torch.ones(1, 1, 2, 256, dtype=torch.bool))
    shapes = _allocations("".join(code))
    assert shapes, "no allocations found: the generated code's format changed"
    assert max(math.prod(shape) for shape in shapes) < cache.numel(), shapes
    assert cache[0, :, 5:7].abs().sum() > 0  # the step did write its keys into the cache itself


def test_fused_greedy_step_ahead_fits_the_tightest_cache():
    """The greedy loop queues a step before reading the last one; with the smallest cache `generate` accepts
    and a drafter that is always right (the fastest-growing case) it must stop queueing, not overflow."""
    new = 14  # 3 drafts + bonus per step: 1 + 3 x 4 = 13 tokens, then a step to 17 with one more queued behind it
    target, drafter = always_right_pair()
    for method in ("tree", "chain"):  # (a top-1 tree: equal draft logits would make a wide one shallow)
        options = dict(method=method, depth=3, tree_top_k=1, total_tokens=3, chain_length=3)
        decoder = Decoder(target, drafter, backend="static", max_length=len(PROMPT) + new + 3 + 2)
        result = decoder.generate(PROMPT, new, **options)
        assert result.tokens == [0] * new, method
        assert result.stats.accepted == [3] * 4, method  # the step queued after the last one is not counted
    random_target = tiny_target("llama")
    result = Decoder(random_target, random_drafter(random_target), backend="static", max_length=len(PROMPT) + new + 10).generate(
        PROMPT, new, method="tree", depth=3, tree_top_k=3, total_tokens=8)
    assert result.tokens == hf_greedy(random_target, new)


def test_fused_loop_launches_no_step_past_the_length_budget(monkeypatch):
    """Once the steps in flight may reach max_new_tokens the loop queues no further step (it would run for nothing):
    a generation ended by its length launches exactly the steps it reads. A first token that is EOS ends it too,
    with the steps queued behind the prefill dropped."""
    from eaglekit.decode import fused

    launches = []
    original = fused.FusedStep._launch
    monkeypatch.setattr(fused.FusedStep, "_launch", lambda self, *a: launches.append(1) or original(self, *a))
    target, drafter = always_right_pair()
    decoder = Decoder(target, drafter, backend="static", max_length=64)
    for new in (14, 13, 2):  # budgets ending mid-step, on a step's last token, and inside the first step
        launches.clear()
        result = decoder.generate(PROMPT, new, method="chain", chain_length=3)
        assert result.tokens == [0] * new and result.finish_reason == "length", new
        assert len(launches) == len(result.stats.accepted), (new, len(launches), result.stats.accepted)
        assert result.stats.discarded_steps == 0, new
    launches.clear()
    result = decoder.generate(PROMPT, 14, method="chain", chain_length=3, eos_token_ids=(0,))
    assert (result.tokens, result.finish_reason, result.stats.accepted) == ([0], "eos", [])
    assert result.stats.discarded_steps == len(launches) > 0


class _HostTraffic(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops that move data between host and device: tensors made from host data (`torch.tensor`), and
    scalar reads (`.item()`, indexing with a 0-d tensor). On a GPU each is a copy, most a synchronisation."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend,compiled", [("eager", False), ("static", False), ("static", True)])
def test_speculative_steps_make_no_host_transfers(backend, compiled, monkeypatch):
    """Besides the verify step's one `.tolist()` (not dispatched, so not counted here), a step (greedy or sampled) adds no
    host<->device traffic: decoding 3x as many tokens makes exactly as many transfers (the prefill's)."""
    from eaglekit.decode import graphs

    # compile=True takes the graph path (the fused step); here it runs uncompiled, since dynamo does not
    # trace under a dispatch mode
    monkeypatch.setattr(graphs, "compiled", lambda fn, enabled: fn)
    monkeypatch.setattr(graphs, "prefill_compiled", lambda fn, enabled: fn)
    target = tiny_target("llama")
    decoder = Decoder(target, random_drafter(target), backend=backend, compile=compiled, max_length=128)
    for method, temperature in (("tree", 0.0), ("chain", 0.0), ("tree", 1.0), ("chain", 1.0)):
        counts, steps = [], []
        options = dict(method=method, depth=3, tree_top_k=3, total_tokens=8, temperature=temperature)
        for new in (NEW, 3 * NEW):
            decoder.generate(PROMPT, new, **options)  # compiles outside the count
            with _HostTraffic() as traffic:
                result = decoder.generate(PROMPT, new, **options)
            counts.append(traffic.count)
            steps.append(len(result.stats.accepted))
        assert steps[1] >= steps[0] + 8, steps  # many more steps: a per-step transfer could not hide
        assert counts[0] == counts[1], (method, temperature, counts)


def test_eager_gpu_attention_path_equals_grouped_query_sdpa():
    # the path eager GPU calls take (no cuDNN: K/V heads repeated) computes what SDPA's enable_gqa does
    from eaglekit.decode.static import attention, attention_without_cudnn

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 5, 16, generator=generator)
    k, v = (torch.randn(1, 2, 12, 16, generator=generator) for _ in range(2))
    mask = (torch.arange(12)[None] <= torch.arange(5)[:, None] + 6)[None, None]  # (1, 1, T, S)
    expected = attention(q, k, v, mask, 0.3)  # CPU: SDPA with enable_gqa
    assert torch.allclose(attention_without_cudnn(q, k, v, mask, 0.3), expected, atol=1e-6)
    assert not torch.allclose(attention_without_cudnn(q, k.roll(1, dims=1), v.roll(1, dims=1), mask, 0.3), expected, atol=1e-3)


def test_decoder_chooses_the_fused_step_by_the_drafters_capability():
    """backend=static takes the fused step for an Eagle3Drafter with a Llama midlayer, and the eager drafter with the
    step-by-step loop for any other object keeping the drafter contract (chosen up front, not by probing attributes)."""
    from eaglekit.decode import static_drafter_supported

    target = tiny_target("llama")
    oracle = OracleDrafter(PROMPT, target.config.num_hidden_layers)
    assert static_drafter_supported(random_drafter(target)) and not static_drafter_supported(oracle)
    assert Decoder(target, random_drafter(target), backend="static").static_drafter
    assert not Decoder(target, oracle, backend="static").static_drafter
    assert not Decoder(target, random_drafter(target), backend="eager").static_drafter
