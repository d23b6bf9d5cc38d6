"""Capture + verification on tiny random models of every family eaglekit promises (CPU, offline)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

from eaglekit.layers import INPUT_OF_LAYER, OUTPUT_OF_LAYER
from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import (
    HiddenStateCapture,
    default_aux_layers,
    engine_aux_layers,
    find_decoder,
    forward_target,
    from_input_convention,
    to_input_convention,
)
from eaglekit.targets.verify import verify_capture

LAYERS = 5
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, image_size=16, patch_size=8)


def _deepseek_v3() -> tf.PretrainedConfig:
    common = {**COMMON, "num_key_value_heads": 4}
    return tf.DeepseekV3Config(**common, moe_intermediate_size=16, n_routed_experts=LAYERS, num_experts_per_tok=2,
                               n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


# name -> (config factory, model class, expected decoder path). Expert counts equal the layer count on
# purpose: an expert ModuleList of the same length must not be mistaken for the decoder.
FAMILIES = {
    "llama": (lambda: tf.LlamaConfig(**COMMON), tf.LlamaForCausalLM, "model.layers"),
    "qwen2": (lambda: tf.Qwen2Config(**COMMON), tf.Qwen2ForCausalLM, "model.layers"),
    "qwen3": (lambda: tf.Qwen3Config(**COMMON, head_dim=8), tf.Qwen3ForCausalLM, "model.layers"),
    "qwen3_moe": (lambda: tf.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=LAYERS, num_experts_per_tok=2,
                                            moe_intermediate_size=16), tf.Qwen3MoeForCausalLM, "model.layers"),
    "mixtral": (lambda: tf.MixtralConfig(**COMMON, num_local_experts=LAYERS, num_experts_per_tok=2),
                tf.MixtralForCausalLM, "model.layers"),
    "deepseek_v3": (_deepseek_v3, tf.DeepseekV3ForCausalLM, "model.layers"),
    "gemma2": (lambda: tf.Gemma2Config(**COMMON, head_dim=8), tf.Gemma2ForCausalLM, "model.layers"),
    "gemma3_text": (lambda: tf.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4), tf.Gemma3ForCausalLM, "model.layers"),
    # LFM2 names its final norm embedding_norm; its short-convolution layers are captured like attention ones
    "lfm2": (lambda: tf.Lfm2Config(**COMMON, layer_types=["conv", "full_attention", "conv", "full_attention", "conv"]),
             tf.Lfm2ForCausalLM, "model.layers"),
    "llava": (lambda: tf.LlavaConfig(text_config=tf.LlamaConfig(**COMMON).to_dict(),
                                     vision_config=tf.CLIPVisionConfig(**VISION).to_dict(), image_token_index=127),
              tf.LlavaForConditionalGeneration, "model.language_model.layers"),
    "mistral3": (lambda: tf.Mistral3Config(text_config=tf.MistralConfig(**COMMON).to_dict(),
                                           vision_config=tf.PixtralVisionConfig(**VISION, head_dim=8).to_dict(),
                                           image_token_index=127),
                 tf.Mistral3ForConditionalGeneration, "model.language_model.layers"),
    "gemma3_vl": (lambda: tf.Gemma3Config(text_config=dict(COMMON, head_dim=8, sliding_window=4),
                                          vision_config=dict(VISION, image_size=16, patch_size=8), mm_tokens_per_image=4,
                                          image_token_index=127, boi_token_index=126, eoi_token_index=125),
                  tf.Gemma3ForConditionalGeneration, "model.language_model.layers"),
    "qwen2_vl": (lambda: tf.Qwen2VLConfig(
        text_config=dict(**COMMON, model_type="qwen2_vl_text", rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         bos_token_id=0, eos_token_id=1),
        vision_config=dict(depth=LAYERS, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1),
        image_token_id=127, video_token_id=126, vision_start_token_id=125),
        tf.Qwen2VLForConditionalGeneration, "model.language_model.layers"),
}


def build(name: str) -> nn.Module:
    make_config, cls, _ = FAMILIES[name]
    torch.manual_seed(0)
    return cls(make_config()).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_matches_output_hidden_states(family):
    model = build(family)
    stack = find_decoder(model)
    assert stack.path == FAMILIES[family][2]
    assert stack.num_layers == LAYERS and stack.norm is not None
    aux_ids = engine_aux_layers(LAYERS)  # (2, 2, 2) for L=5: repeated ids get one hook
    input_ids = torch.randint(0, 100, (2, 7))
    with HiddenStateCapture(model, aux_ids) as capture:
        result = verify_capture(model, capture, input_ids)
        assert result.ok and result.reference == "output_hidden_states"
        assert result.hook_calls == {"aux2": 1, "final": 1}
        assert set(result.compared) == {"aux2", "final"}
        with torch.inference_mode():
            reference = forward_target(model, input_ids, output_hidden_states=True).hidden_states
            capture.reset()
            forward_target(model, input_ids)
        aux, final = capture.aux(), capture.final()
    assert aux.shape == (2, 7, 3 * 32) and final.shape == (2, 7, 32)
    assert torch.equal(aux[..., :32], reference[2])
    assert torch.equal(final, reference[-1])


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "llava"])
def test_every_layer_id_including_embeddings_and_last(family):
    model = build(family)
    input_ids = torch.randint(0, 100, (1, 6))
    with torch.inference_mode():
        reference = forward_target(model, input_ids, output_hidden_states=True).hidden_states
    with HiddenStateCapture(model, (0, 1, LAYERS - 1)) as capture, torch.inference_mode():
        forward_target(model, input_ids)
        aux = capture.aux()
    for slot, layer_id in enumerate((0, 1, LAYERS - 1)):
        assert torch.equal(aux[..., slot * 32:(slot + 1) * 32], reference[layer_id])
    # id L = the last layer's output BEFORE the final norm: norm(it) is the final hidden state
    with HiddenStateCapture(model, (LAYERS, LAYERS, LAYERS)) as capture, torch.inference_mode():
        forward_target(model, input_ids)
        last = capture.aux()[..., :32]
        assert torch.allclose(find_decoder(model).norm(last), capture.final(), atol=1e-6)
        assert not torch.allclose(last, capture.final())


def test_wrapper_capture_reaches_the_inner_decoder():
    """The seed bug: hooks on the language model must fire when the WRAPPER runs, and see its states."""
    wrapper = build("llava")
    inner = wrapper.model.language_model
    assert find_decoder(wrapper).layers is inner.layers
    input_ids = torch.randint(0, 100, (2, 5))
    with HiddenStateCapture(wrapper, (1, 2, 3)) as capture:
        verify_capture(wrapper, capture, input_ids)
        with torch.inference_mode():
            forward_target(wrapper, input_ids)
        assert capture.calls == {"aux1": 1, "aux2": 1, "aux3": 1, "final": 1}
        via_wrapper = capture.aux()
    with torch.inference_mode():
        direct = inner(input_ids=input_ids, output_hidden_states=True).hidden_states
    assert torch.equal(via_wrapper, torch.cat([direct[1], direct[2], direct[3]], dim=-1))


class PatchedButUnused(nn.Module):
    """A wrapper that runs its `language_model` but also holds a second, never-executed decoder (the
    class someone patched), like an engine loading `KimiK25ForConditionalGeneration`."""

    def __init__(self):
        super().__init__()
        self.language_model = build("llama")
        self.patched = build("llama").model
        self.config = self.language_model.config

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, use_cache=False):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask,
                                   output_hidden_states=output_hidden_states, use_cache=use_cache)


def test_verification_catches_hooks_on_a_class_that_does_not_run():
    model = PatchedButUnused()
    with HiddenStateCapture(model, (1, 2, 3), decoder_path="patched.layers") as capture:
        with pytest.raises(EaglekitError, match=r"did not fire.*PatchedButUnused.*patched\.layers"):
            verify_capture(model, capture, torch.randint(0, 100, (1, 4)))
    with HiddenStateCapture(model, (1, 2, 3), decoder_path="language_model.model.layers") as capture:
        assert verify_capture(model, capture, torch.randint(0, 100, (1, 4))).ok


class CallsStackTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = build("llama")
        self.config = self.model.config

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        self.model(input_ids=input_ids)
        return self.model(input_ids=input_ids, output_hidden_states=output_hidden_states)


def test_verification_catches_double_calls_and_wrong_tap_point():
    model = CallsStackTwice()
    with HiddenStateCapture(model, (1, 2, 3)) as capture:
        with pytest.raises(EaglekitError, match="wrong number of times"):
            verify_capture(model, capture, torch.randint(0, 100, (1, 4)))
    llama = build("llama")
    with HiddenStateCapture(llama, (1, 2, 3)) as capture:
        capture.states = _Shifted()  # every captured state altered, as a hook at a wrong tap point would see
        with pytest.raises(EaglekitError, match="differs from output_hidden_states"):
            verify_capture(llama, capture, torch.randint(0, 100, (1, 4)))


class _Shifted(dict):
    """Stores every captured state scaled, as a hook at a wrong tap point would."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value * 1.5)


def test_layer_id_conventions_and_bounds():
    assert default_aux_layers(32) == (2, 16, 29)
    assert to_input_convention((1, 15, 28), OUTPUT_OF_LAYER) == (2, 16, 29)
    assert from_input_convention((2, 16, 29), OUTPUT_OF_LAYER) == (1, 15, 28)
    assert to_input_convention((2, 16, 29), INPUT_OF_LAYER) == (2, 16, 29)
    model = build("llama")
    with HiddenStateCapture(model, (0, 1, 2), convention=OUTPUT_OF_LAYER) as capture:
        assert capture.aux_layers == (1, 2, 3)
    with pytest.raises(EaglekitError, match="out of range.*5 layers"):
        HiddenStateCapture(model, (2, 3, 6))
    assert engine_aux_layers(4) == (2, 2, 1) and default_aux_layers(4) == (1, 2, 3)  # small targets: distinct layers
    assert default_aux_layers(3) == (1, 2, 3) and default_aux_layers(6) == (1, 3, 5) and default_aux_layers(7) == (2, 3, 4)
    with pytest.raises(EaglekitError, match="at least 3"):
        default_aux_layers(2)
    with pytest.raises(EaglekitError, match="not a ModuleList"):
        find_decoder(model, "model.nothing")


def test_target_report_on_a_saved_wrapper(tmp_path):
    from eaglekit.targets.inspection import format_target_report, target_report

    build("llava").save_pretrained(tmp_path)
    report = target_report(str(tmp_path))
    assert report["class"] == "LlavaForConditionalGeneration" and report["decoder_path"] == "model.language_model.layers"
    assert report["layer_class"] == "LlamaDecoderLayer" and report["num_layers"] == LAYERS
    assert report["verification"]["ok"] and report["verification"]["compared"] == ["aux1", "aux2", "aux4", "final"]  # L=5: distinct (1, 2, 4)
    assert "decoder path:     model.language_model.layers" in format_target_report(report)


class PreNormLastHiddenState(nn.Module):
    """A model whose `hidden_states[-1]` is the last layer's output BEFORE the final norm (older
    transformers conventions): verification must still pass, comparing after the norm."""

    def __init__(self):
        super().__init__()
        self.inner = build("llama")
        self.config = self.inner.config

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        seen = {}
        handle = self.inner.model.norm.register_forward_hook(lambda module, args, output: seen.update(pre_norm=args[0]))
        out = self.inner(input_ids=input_ids, output_hidden_states=output_hidden_states)
        handle.remove()
        if output_hidden_states:
            out.hidden_states = out.hidden_states[:-1] + (seen["pre_norm"],)
        return out


def test_verification_accepts_a_pre_norm_last_hidden_state():
    model = PreNormLastHiddenState()
    with HiddenStateCapture(model, (1, 2, 3)) as capture:
        result = verify_capture(model, capture, torch.randint(0, 100, (1, 5)))
    assert result.ok and "before the final norm" in result.reference and "final" in result.compared


def test_a_final_norm_of_an_unknown_name_is_one_error_naming_both_fixes():
    model = build("llama")
    model.model.final_rms = model.model.norm
    del model.model.norm
    with pytest.raises(EaglekitError) as error:
        HiddenStateCapture(model, (1, 2, 3))
    message = str(error.value)
    assert message.startswith("no final norm (norm, final_layernorm, ln_f, final_layer_norm, embedding_norm) found "
                              "next to model.layers in LlamaForCausalLM: if model.layers is not the text decoder's")
    assert "pass decoder_path=" in message and "names its final norm otherwise" in message
