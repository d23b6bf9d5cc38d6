"""The MLA drafter (drafter_arch=mla): its attention against transformers' DeepSeek-V3 attention (RoPE interleave,
YaRN), the cache/mask contract the decoder and TTT rely on, persistence, and configuration errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglekit.drafters.eagle3 import mla
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_forward
from eaglekit.training.objective import soft_labels
from eaglekit.errors import EaglekitError

H, HEADS, VOCAB = 32, 4, 96
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}


def mla_config(**overrides) -> DrafterConfig:
    fields = dict(hidden_size=H, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  vocab_size=VOCAB, draft_vocab_size=48, target_hidden_size=H, aux_layer_ids=(1, 2, 3),
                  drafter_arch="mla", q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
                  v_head_dim=10, rms_norm_eps=1e-6, max_position_embeddings=64)
    return DrafterConfig(**{**fields, **overrides})


def mla_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(mla_config(**overrides))
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so a swapped norm shows
                parameter.uniform_(0.5, 1.5)
        drafter.embed_tokens.weight.normal_()
    drafter.set_vocab_mapping(torch.arange(0, VOCAB, 2))
    return drafter.eval()


def causal(t: int, past: int = 0) -> torch.Tensor:
    return torch.ones(t, past + t, dtype=torch.bool).tril(past)[None, None]  # (1, 1, T, past + T)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, YARN], ids=["default", "yarn"])
def test_attention_equals_transformers_deepseek_v3(rope):
    """Our MLA attention = transformers' DeepseekV3Attention (interleaved RoPE, YaRN frequencies and both mscales)
    built with a 2H-wide input and our o_proj."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    drafter = mla_drafter(rope_parameters=rope)
    ours, c = drafter.midlayer.self_attn, drafter.config
    hf_config = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                 q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=8,
                                 qk_rope_head_dim=6, v_head_dim=10,
                                 rope_scaling=None if rope is not YARN else dict(rope),
                                 rope_theta=10000.0, max_position_embeddings=64, rope_interleave=True,
                                 rms_norm_eps=1e-6, attention_bias=False)
    hf_config._attn_implementation = "eager"
    reference = DeepseekV3Attention(hf_config, layer_idx=0)
    reference.o_proj = ours.o_proj  # (H, nh*Dv): ours writes H, not the reference's 2H
    reference.load_state_dict(ours.state_dict(), strict=True)
    rotary = DeepseekV3RotaryEmbedding(hf_config)
    x, positions = torch.randn(2, 7, 2 * H), torch.arange(3, 10).expand(2, 7)
    mask = causal(7)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected = reference(x, rotary(x, positions), additive)[0]
    cos, sin = drafter.rotary_emb(x, positions)
    got, _ = ours(x, cos, sin, None, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_yarn_scales_follow_vllm():
    """cos/sin carry mscale(f, mscale)/mscale(f, mscale_all_dim); the softmax scale mscale(f, mscale_all_dim)^2;
    attention_factor 1.0 (vLLM's llama-scaling case) drops the softmax factor."""
    magnitude, softmax = mla.rope_scales(YARN)
    assert magnitude == pytest.approx((0.1 * 0.9 * torch.log(torch.tensor(4.0)).item() + 1)
                                      / (0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1))
    assert softmax == pytest.approx((0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    assert mla.rope_scales({**YARN, "attention_factor": 1.0})[1] == 1.0
    assert mla.rope_scales({"rope_type": "default", "rope_theta": 5.0}) == (1.0, 1.0)


def test_rotation_is_interleaved_pairs():
    """Pair (2i, 2i+1) rotates by frequency i: position 1 turns (1, 0) of pair 0 by one radian."""
    x = torch.zeros(1, 1, 1, 6)
    x[..., 0] = 1.0
    rotary = mla.MLARotaryEmbedding(mla_config())
    cos, sin = rotary(x, torch.ones(1, 1, dtype=torch.long))
    out = mla.rotate_interleaved(x, cos[:, None], sin[:, None])
    expected = torch.zeros(6)
    expected[0], expected[1] = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(out.flatten(), expected)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, YARN], ids=["default", "yarn"])
def test_cached_steps_equal_one_full_forward(rope):
    """The caller-owned cache holds decompressed per-head keys/values: a prefix forward then one position at a
    time with the cache gives what one causal forward over all positions gives (the decoder's contract)."""
    drafter = mla_drafter(rope_parameters=rope)
    hidden, ids = torch.randn(1, 6, H), torch.randint(0, VOCAB, (1, 6))
    positions = torch.arange(6)[None]
    full_hidden, full_logits, _ = drafter(hidden, ids, positions, None, causal(6))
    out, logits, past = drafter(hidden[:, :3], ids[:, :3], positions[:, :3], None, causal(3))
    assert past[0].shape == (1, HEADS, 3, 8 + 6) and past[1].shape == (1, HEADS, 3, 10)
    outs, all_logits = [out], [logits]
    for t in range(3, 6):
        step = slice(t, t + 1)
        out, logits, (k, v) = drafter(hidden[:, step], ids[:, step], positions[:, step], past, causal(1, t))
        past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        outs.append(out)
        all_logits.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(all_logits, 1), full_logits, rtol=1e-5, atol=1e-5)


def test_ttt_sdpa_and_flex_agree_and_train():
    """TTT runs the MLA drafter through the same contract: the boolean-mask and block-mask paths agree, and a few
    optimiser steps lower the loss."""
    drafter = mla_drafter().train()
    b, t = 2, 12
    aux, ids = torch.randn(b, t, 3 * H), torch.randint(0, VOCAB, (b, t))
    probs, in_vocab = soft_labels(torch.randn(b, t, VOCAB) * 3, drafter.t2d)
    loss_mask = torch.ones(b, t, dtype=torch.bool)
    with torch.no_grad():  # flex attention has no CPU backward
        sdpa = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3)
        flex = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3, attention="flex")
    torch.testing.assert_close(flex.loss_sums, sdpa.loss_sums, rtol=1e-4, atol=1e-4)
    optimiser = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(8):
        result = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=3)
        first = result.loss.item() if first is None else first
        optimiser.zero_grad()
        result.loss.backward()
        optimiser.step()
    assert result.loss.item() < 0.9 * first
    assert drafter.midlayer.self_attn.q_a_proj.weight.grad is not None


def test_save_and_load_keep_logits(tmp_path):
    drafter = mla_drafter(rope_parameters=YARN)
    drafter.save_pretrained(tmp_path / "d")
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "d").eval()
    assert loaded.config == drafter.config and isinstance(loaded.midlayer, mla.MLADecoderLayer)
    hidden, ids, positions = torch.randn(1, 5, H), torch.randint(0, VOCAB, (1, 5)), torch.arange(5)[None]
    torch.testing.assert_close(loaded(hidden, ids, positions, None, causal(5))[1],
                               drafter(hidden, ids, positions, None, causal(5))[1], rtol=0, atol=0)


def test_tensor_names_are_the_engines():
    state = mla_drafter().state_dict()
    names = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    for name in names:
        assert f"midlayer.self_attn.{name}.weight" in state
    layer = {"midlayer.mlp.gate_proj.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"}
    assert layer <= set(state)
    assert tuple(state["midlayer.self_attn.q_a_proj.weight"].shape) == (24, 2 * H)  # reads [norm(emb), norm(feature)]
    assert tuple(state["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape) == (20 + 6, 2 * H)


@pytest.mark.parametrize("overrides, words", [
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"kv_lora_rank": 0, "v_head_dim": 0}, "kv_lora_rank, v_head_dim"),
    ({"qk_rope_head_dim": 5}, "even"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}}, "llama3"),
])
def test_config_errors_name_the_fix(overrides, words):
    with pytest.raises(EaglekitError, match=words):
        Eagle3Drafter(mla_config(**overrides))


def test_dims_from_an_mla_target_config():
    from transformers import DeepseekV3Config, LlamaConfig

    target = DeepseekV3Config(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert mla.mla_dims(target) == {"q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                    "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert mla.mla_dims(LlamaConfig()) is None
    assert dataclasses.replace(mla_config(), **mla.mla_dims(target)).kv_lora_rank == 32


# --- engine layouts ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_import_round_trip_keeps_logits(tmp_path, fmt, variant):
    """vLLM/SGLang layout of the MLA drafter (Eagle3DeepseekV2ForCausalLM, a DeepSeek-V3-schema config), also as
    EAGLE 3.1 (fc_norm + norm_output, which both engines' MLA drafters read), reads back with the same numbers and
    the same configuration."""
    import json

    from transformers import DeepseekV3Config

    from eaglekit.drafters.eagle3.convert import export_drafter, import_checkpoint, probe_logits

    drafter = mla_drafter(rope_parameters=YARN, **variant)
    summary = export_drafter(drafter, tmp_path / fmt, fmt)
    data = json.loads((tmp_path / fmt / "config.json").read_text())
    assert data["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and data["model_type"] == "kimi_k2"
    assert data["num_hidden_layers"] == 1 and data["tie_word_embeddings"] is False and data["q_lora_rank"] == 24
    deepseek = DeepseekV3Config.from_dict(data)  # the schema both engines parse it with
    dims = (deepseek.kv_lora_rank, deepseek.qk_nope_head_dim, deepseek.qk_rope_head_dim, deepseek.v_head_dim)
    assert dims == (20, 8, 6, 10)
    assert deepseek.rope_parameters["rope_type"] == "yarn" and deepseek.rope_parameters["mscale_all_dim"] == 0.7
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in summary["tensors"]
    assert summary["max_logit_difference"] == 0.0
    assert data["fc_norm"] == bool(variant) and data["norm_output"] == bool(variant)
    assert ("fc_norm.2.weight" in summary["tensors"]) == bool(variant)
    back = import_checkpoint(tmp_path / fmt, from_format=fmt)
    assert back.config == drafter.config
    torch.testing.assert_close(probe_logits(back), probe_logits(drafter), rtol=0, atol=0)


def test_export_refusals_name_the_fix(tmp_path):
    from eaglekit.drafters.eagle3.convert import export_drafter

    with pytest.raises(EaglekitError, match="speculators has no MLA drafter"):
        export_drafter(mla_drafter(), tmp_path / "s", "speculators")
    with pytest.raises(EaglekitError, match="norm_before_fc"):
        export_drafter(mla_drafter(norm_before_fc=True), tmp_path / "v", "vllm")


def test_required_key_check_covers_the_mla_tensors():
    """SGLang skips missing tensors silently: the exporter's key check lists every MLA tensor."""
    from eaglekit.drafters.eagle3 import formats

    config = mla_config()
    state = formats.to_checkpoint_state(mla_drafter().state_dict(), "sglang")
    del state["midlayer.self_attn.kv_b_proj.weight"]
    with pytest.raises(EaglekitError, match="kv_b_proj"):
        formats.check_required("sglang", config, state)
    assert "midlayer.self_attn.q_proj.weight" not in formats.required_keys("vllm", config)


# --- training ---------------------------------------------------------------------------------
def tiny_deepseek_target(directory) -> str:
    """A tiny random DeepSeek-V3 (MLA + MoE) checkpoint with the built-in tiny target's tokenizer."""
    import shutil

    import transformers as tf

    from eaglekit.targets.loading import tiny_target_path

    torch.manual_seed(0)
    config = tf.DeepseekV3Config(vocab_size=4096, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                 topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                 v_head_dim=12, max_position_embeddings=256, tie_word_embeddings=False,
                                 rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                               "original_max_position_embeddings": 128})
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_path() / name, directory / name)
    return str(directory)


def train_config(target: str, output, **overrides):
    from eaglekit.config.train import TrainConfig

    from engines import PROMPTS

    fields = dict(target=target, data=(str(PROMPTS),), output=str(output), draft_vocab_size=256, ttt_steps=2,
                  max_steps=2, batch_size=2, max_length=48, val_fraction=0.0, log_every=1000, save_every=100000,
                  device="cpu", dtype="fp32", drafter_arch="mla")
    return TrainConfig(**{**fields, **overrides})


def test_train_drafter_arch_mla_takes_the_targets_dims(tmp_path):
    """`eaglekit train drafter_arch=mla` on an MLA target: the drafter's MLA dims and YaRN RoPE are the target's;
    an explicit option wins over the target's value."""
    from eaglekit.training.loop import train

    target = tiny_deepseek_target(tmp_path / "target")
    train(train_config(target, tmp_path / "drafter", v_head_dim=6))
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "drafter")
    c = drafter.config
    assert c.drafter_arch == "mla" and isinstance(drafter.midlayer, mla.MLADecoderLayer)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (24, 16, 8, 8, 6)
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["factor"] == 2.0


def test_train_drafter_arch_mla_on_a_non_mla_target_names_the_options(tmp_path):
    from eaglekit.training.loop import train

    with pytest.raises(EaglekitError, match="q_lora_rank=N kv_lora_rank=N"):
        train(train_config("tiny", tmp_path / "drafter"))


# --- decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, backend", [("deepseek_v3", "eager"), ("llama", "static")])
def test_speculative_greedy_equals_the_targets_with_an_mla_drafter(kind, backend):
    """The decoder runs the MLA drafter (eager drafter step, also under backend=static) and greedy speculative
    decoding gives the target's own greedy tokens, chain and tree."""
    from builders import VOCAB as TARGET_VOCAB
    from builders import tiny_target

    from eaglekit.decode import Decoder, static_drafter_supported

    target = tiny_target(kind)
    torch.manual_seed(3)
    config = mla_config(vocab_size=TARGET_VOCAB, draft_vocab_size=64, aux_layer_ids=(1, 2, 3), target_num_layers=4)
    drafter = Eagle3Drafter(config).eval()
    drafter.set_vocab_mapping(torch.arange(64) + 7)  # a draft vocabulary of 64 of the target's 96 ids
    drafter.load_target_embedding(target.get_input_embeddings().weight)
    assert not static_drafter_supported(drafter)
    prompt = [5, 17, 33, 2, 71, 40]
    plain = Decoder(target, None, backend, max_length=128).generate(prompt, 16, method="plain").tokens
    decoder = Decoder(target, drafter, backend, max_length=128)
    for method in ("chain", "tree"):
        result = decoder.generate(prompt, 16, method=method, chain_length=3, depth=3, tree_top_k=2, total_tokens=6)
        assert result.tokens == plain, method


def test_import_reads_a_published_style_layers_0_checkpoint(tmp_path):
    """Published MLA drafters (and vLLM/SGLang loaders) use `layers.0.` for the midlayer: import reads it as is."""
    import json

    from safetensors.torch import load_file, save_file

    from eaglekit.drafters.eagle3.convert import export_drafter, import_checkpoint, probe_logits

    drafter = mla_drafter()
    export_drafter(drafter, tmp_path / "v", "vllm")
    state = load_file(str(tmp_path / "v" / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "v" / "model.safetensors"))
    data = json.loads((tmp_path / "v" / "config.json").read_text())
    data.pop("eaglekit_export")  # as published: no eaglekit marker
    (tmp_path / "v" / "config.json").write_text(json.dumps(data))
    back = import_checkpoint(tmp_path / "v", from_format="vllm")
    assert back.config.drafter_arch == "mla"
    torch.testing.assert_close(probe_logits(back), probe_logits(drafter), rtol=0, atol=0)
