"""The static target's fused q/k/v and gate/up GEMMs: the same logits as the separate projections, no weight copied."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eaglekit.decode.static import StaticLlama

SHAPE = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize("model_class, config_class", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config),
                                                        (Qwen3ForCausalLM, Qwen3Config)], ids=["llama", "qwen2-bias", "qwen3"])
def test_fused_projections_equal_separate_ones_and_share_the_weights(model_class, config_class):
    model = model_class(config_class(**SHAPE)).eval()
    ids = torch.randint(0, 100, (7,))
    mask = torch.ones(7, 16, dtype=torch.bool).tril()[None, None]  # (1, 1, T, capacity)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    separate = StaticLlama(model, 16, (0, 1, 2), fuse_projections=False)
    assert not separate.fused
    expected, expected_aux = separate(ids, torch.arange(7), torch.arange(7), mask)
    fused = StaticLlama(model, 16, (0, 1, 2))
    assert fused.fused
    logits, aux = fused(ids, torch.arange(7), torch.arange(7), mask)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, expected_aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids[None]).logits[0], expected, rtol=1e-5, atol=1e-5)  # the HF model is unchanged
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # a view: no copy of the weights
    assert set(model.state_dict()) == set(state_before)  # the fused buffers are not saved with the model
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state_before[name], rtol=0, atol=0)


def test_quantised_or_mixed_weights_keep_the_separate_projections():
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().to(torch.float64))  # another dtype
    net = StaticLlama(model, 16, None)
    assert not net.fused and not hasattr(attn, "qkv_weight")
