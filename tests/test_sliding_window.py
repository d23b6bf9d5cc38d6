"""Sliding-window and hybrid-attention targets (Gemma-2/3, Mistral with `sliding_window`, Qwen2/Qwen3 whose
`layer_types` mix full and sliding layers): plain, chain and tree decoding give transformers' greedy tokens
(generations run well past the window, and draft trees deeper than it), on the eager reference, the static cache
and the fused step (also traced as a compiled graph); targets with layers eaglekit cannot cut back to the accepted
path (chunked attention) decode plain exactly and are refused for speculative decoding with the reason; the
hidden-state capture that extract and train use works on all of them."""

from __future__ import annotations

import pytest
import torch

from builders import OracleDrafter, random_drafter
from eaglekit.decode import Decoder, generate
from eaglekit.decode.windows import check_speculative, config_windows, layer_kinds, window_mask
from eaglekit.errors import EaglekitError

WINDOW = 4
PROMPT = [10, 56, 25, 3, 88, 41]
NEW = 20
SHORT = 10  # a random drafter's generations (mostly one token a step): still past the window
KINDS = ("gemma2", "gemma3", "mistral", "qwen2", "qwen3")
STATIC_KINDS = ("mistral", "qwen2", "qwen3")  # the static fast path's model types among them
SLIDING, FULL = "sliding_attention", "full_attention"
TREE = dict(method="tree", depth=5, tree_top_k=2, total_tokens=8)  # deeper than the window


def target_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "gemma2":  # sliding, full, sliding, full
        return tf.Gemma2Config(**common, head_dim=8, sliding_window=WINDOW)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=WINDOW, layer_types=[SLIDING, FULL] * 2)
    if kind == "mistral":  # every layer slides
        return tf.MistralConfig(**common, sliding_window=WINDOW)
    if kind == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, layer_types=[FULL, SLIDING] * 2)
    if kind == "qwen3":  # full, full, sliding, sliding (layers from max_window_layers on slide)
        return tf.Qwen3Config(**common, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if kind == "llama4":  # chunked attention in three layers of four
        return tf.Llama4TextConfig(**{**common, "intermediate_size_mlp": 64}, head_dim=8, attention_chunk_size=WINDOW,
                                   num_local_experts=2)
    raise ValueError(kind)


def sliding_target(kind: str) -> torch.nn.Module:
    """A tiny random target of `kind`; no EOS (generations run to their length)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(target_config(kind)).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=KINDS)
def case(request):
    model = sliding_target(request.param)
    return request.param, model, hf_greedy(model, PROMPT, NEW)


# ---- which layers slide, and the mask ------------------------------------------------------------

def test_layer_windows_follow_the_modelling_code():
    import transformers as tf

    assert config_windows(target_config("gemma2")) == (WINDOW, None, WINDOW, None)
    assert config_windows(target_config("gemma3")) == (WINDOW, None, WINDOW, None)
    assert config_windows(target_config("mistral")) == (WINDOW,) * 4
    assert config_windows(target_config("qwen2")) == (None, WINDOW, None, WINDOW)
    assert config_windows(target_config("qwen3")) == (None, None, WINDOW, WINDOW)
    unused = tf.Qwen2Config(num_hidden_layers=3, sliding_window=8)  # without use_sliding_window
    assert config_windows(unused) == (None,) * 3
    assert config_windows(tf.MistralConfig(num_hidden_layers=2, sliding_window=None)) == (None, None)
    assert config_windows(tf.LlamaConfig(num_hidden_layers=2)) == (None, None)
    assert layer_kinds(target_config("llama4")) == ("chunked_attention",) * 3 + (FULL,)
    with pytest.raises(EaglekitError, match="chunked_attention layers: speculative decoding .* method=plain"):
        check_speculative(target_config("llama4"))
    check_speculative(target_config("gemma3"))  # full and sliding layers: accepted


def test_window_mask_counts_positions_not_slots():
    """A key is seen when q - W < k <= q by position; a tree node at depth 2 (position m + 2) sits in slot m + 5."""
    mask = torch.ones(2, 8, dtype=torch.bool)
    keys = torch.tensor([0, 1, 2, 3, 4, 5, 4, 6])  # slot 6 holds a draft at position 4
    got = window_mask(mask, torch.tensor([4, 6]), keys, 3)
    assert got[0].tolist() == [False, False, True, True, True, True, True, True]
    assert got[1].tolist() == [False, False, False, False, True, True, True, True]


# ---- decoding equals transformers' greedy --------------------------------------------------------

def test_eager_decoding_equals_hf_greedy(case):
    kind, model, reference = case
    assert generate(model, None, PROMPT, NEW, method="plain").tokens == reference, kind
    oracle = OracleDrafter(PROMPT + reference, 4)  # every draft accepted: paths of 5 tokens across the window
    for options in (TREE, dict(method="chain", chain_length=5)):
        result = generate(model, oracle, PROMPT, NEW, **options)
        assert result.tokens == reference and result.stats.tau > 4, (kind, options)
    drafted = generate(model, random_drafter(model), PROMPT, SHORT, backend="eager", **TREE)
    assert drafted.tokens == reference[:SHORT], kind  # partial acceptance: the cache compacted to the accepted paths


@pytest.mark.parametrize("kind", STATIC_KINDS)
def test_static_and_fused_paths_equal_hf_greedy(kind):
    model = sliding_target(kind)
    reference = hf_greedy(model, PROMPT, NEW)
    decoder = Decoder(model, random_drafter(model), backend="static", max_length=64)
    assert decoder.generate(PROMPT, NEW, method="plain").tokens == reference
    assert decoder.generate(PROMPT, SHORT, **TREE).tokens == reference[:SHORT]  # the one-function step
    oracle = OracleDrafter(PROMPT + reference, 4)  # the step-by-step loop over the static target, whole paths kept
    assert generate(model, oracle, PROMPT, NEW, backend="static", **TREE).tokens == reference


def test_fused_step_equals_the_eager_reference_step_for_step():
    """Full and sliding layers mixed (Qwen3): the fused step accepts what the eager loop accepts, step for step,
    greedy and sampled, chain and tree."""
    model = sliding_target("qwen3")
    drafter = random_drafter(model)
    decoder = Decoder(model, drafter, backend="static", max_length=64)
    for options in (TREE, dict(method="chain", chain_length=3), dict(TREE, temperature=1.0, seed=2)):
        fused = decoder.generate(PROMPT, SHORT, **options)
        eager = generate(model, drafter, PROMPT, SHORT, backend="eager", **options)
        assert (fused.tokens, fused.stats.accepted) == (eager.tokens, eager.stats.accepted), options


def test_compiled_fused_step_honours_the_windows(monkeypatch):
    """compile=True traced on the CPU (a frame-counting backend in place of inductor + CUDA graphs): the same
    tokens as transformers, a whole step one graph."""
    from torch._dynamo.testing import CompileCounter

    from eaglekit.decode import graphs

    torch._dynamo.reset()
    counter, prefills = CompileCounter(), CompileCounter()
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": prefills, "fullgraph": True, "dynamic": None})
    model = sliding_target("qwen3")
    reference = hf_greedy(model, PROMPT, NEW)
    decoder = Decoder(model, random_drafter(model), backend="static", compile=True, max_length=96)
    assert decoder.generate(PROMPT, SHORT, **TREE).tokens == reference[:SHORT]
    assert counter.frame_count == 1 and prefills.frame_count == 2


def test_chunked_attention_decodes_plain_and_refuses_speculative():
    """Chunked layers (Llama-4) keep the model's own masks and cache: plain decoding is exact past the chunk;
    chain and tree are refused before any work, naming the layers and the fix; the static path refuses them."""
    model = sliding_target("llama4")
    reference = hf_greedy(model, PROMPT, 12)
    assert generate(model, None, PROMPT, 12, method="plain").tokens == reference
    oracle = OracleDrafter(PROMPT + reference, 4)
    for method in ("chain", "tree"):
        with pytest.raises(EaglekitError, match="chunked_attention layers: speculative decoding keeps only"):
            generate(model, oracle, PROMPT, 12, method=method)
    with pytest.raises(EaglekitError, match="static fast path covers .* not 'llama4_text'; use backend=eager"):
        generate(model, None, PROMPT, 12, method="plain", backend="static")


# ---- what extract and train run on these targets ------------------------------------------------------

@pytest.mark.parametrize("kind", ("gemma3", "qwen3"))
def test_hidden_state_capture_on_sliding_targets(kind):
    from eaglekit.targets.capture import HiddenStateCapture
    from eaglekit.targets.verify import verify_capture

    model = sliding_target(kind)
    probe = torch.tensor([PROMPT * 3])  # past the window
    with HiddenStateCapture(model, (1, 2, 3)) as capture:
        result = verify_capture(model, capture, probe)
    assert result.ok and result.compared, result
    with HiddenStateCapture(model, (1, 2, 3)) as capture, torch.no_grad():
        hidden = model(probe, output_hidden_states=True).hidden_states
        assert torch.equal(capture.aux()[0], torch.cat([hidden[1], hidden[2], hidden[3]], -1)[0])


# ---- CUDA: the compiled fast path (inductor, CUDA graphs) ------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ("qwen3", "mistral"))
def test_compiled_cuda_fast_path_with_windows_equals_eager(kind):
    torch._dynamo.reset()
    model = sliding_target(kind).cuda()
    drafter = random_drafter(model).cuda()
    decoder = Decoder(model, drafter, backend="static", compile=True, max_length=160)
    long_prompt = [(7 * i) % 40 + 1 for i in range(70)]  # the prefills' second bucket
    for options in (dict(method="plain"), TREE, dict(method="chain", chain_length=3), dict(TREE, temperature=1.0)):
        for prompt in (PROMPT, long_prompt):
            expected = generate(model, drafter, prompt, NEW, backend="eager", **options)
            fast = decoder.generate(prompt, NEW, **options)
            assert (fast.tokens, fast.stats.accepted) == (expected.tokens, expected.stats.accepted), (options, prompt)
