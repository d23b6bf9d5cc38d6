"""Training's soft labels equal the target's own next-token distribution on families whose forward changes
lm_head's output: Granite (logits_scaling), Cohere (logit_scale), Gemma-2 (final_logit_softcapping), Phi (an
lm_head bias, read from the checkpoint for offline training)."""

from __future__ import annotations

import pytest
import torch
import transformers

from eaglekit.training.objective import soft_labels_from_hidden
from eaglekit.targets.output_head import LogitTransform, logit_transform

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22)),
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, dict(logit_scale=0.0625)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(final_logit_softcapping=0.5, head_dim=8, sliding_window=16, initializer_range=0.5)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_soft_labels_equal_the_targets_distribution(family):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**SMALL, **extra)).eval()
    assert logit_transform(model.config) != LogitTransform()
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    expected = torch.softmax(out.logits.float(), -1)  # (B, T, V): the target's own distribution
    final = out.hidden_states[-1]  # (B, T, H) after the final norm: what extract stores
    t2d = torch.ones(96, dtype=torch.bool)
    weight = model.get_output_embeddings().weight
    probs, _ = soft_labels_from_hidden(final, weight, t2d, transform=logit_transform(model.config))
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)
    plain, _ = soft_labels_from_hidden(final, weight, t2d)  # without the transform: another distribution
    assert (plain - expected).abs().max() > 1e-3


def test_llama_needs_no_transform():
    assert logit_transform(transformers.LlamaConfig(**SMALL)) == LogitTransform()


def test_an_lm_head_bias_is_read_from_the_checkpoint_and_added(tmp_path):
    from eaglekit.training.target_weights import load_target_head_bias

    torch.manual_seed(0)
    model = transformers.PhiForCausalLM(transformers.PhiConfig(**SMALL)).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 2.0)  # a bias that moves the distribution
    model.save_pretrained(tmp_path)
    bias = load_target_head_bias(str(tmp_path))
    torch.testing.assert_close(bias, model.lm_head.bias.detach())
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    t2d = torch.ones(96, dtype=torch.bool)
    probs, _ = soft_labels_from_hidden(out.hidden_states[-1], model.lm_head.weight, t2d,
                                       transform=logit_transform(model.config, bias))
    torch.testing.assert_close(probs, torch.softmax(out.logits.float(), -1), atol=1e-5, rtol=1e-4)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(tmp_path / "llama")
    assert load_target_head_bias(str(tmp_path / "llama")) is None
