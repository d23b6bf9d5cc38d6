"""The engine layout of the MLA drafter (`drafter_arch="mla"`, `eaglekit.drafters.eagle3.mla`), for vLLM and SGLang.

Both engines serve it as architecture `Eagle3DeepseekV2ForCausalLM` (vLLM `model_executor/models/deepseek_eagle3.py`,
SGLang `srt/models/kimi_k25_eagle3.py`) from a DeepSeek-V3-schema config.json:

- `model_type: "kimi_k2"`: both engines map it to transformers' DeepseekV3Config (SGLang registers the alias for
  this drafter). Not "deepseek_v3": vLLM's speculative config rewrites a deepseek_v3 draft config into its MTP
  model (`SpeculativeConfig.hf_config_override`).
- the MLA dimensions `q_lora_rank` (SGLang raises without it), `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`; `num_hidden_layers: 1` (SGLang raises otherwise); `tie_word_embeddings: false`
  (SGLang ties lm_head to the embedding when true); `rope_theta` / `rope_scaling` (YaRN keys as DeepSeek names them),
  `rope_interleave: true` (DeepSeek's pair layout; SGLang reads it, vLLM always uses it);
- the EAGLE-3 keys of the Llama layout: `draft_vocab_size`, `target_hidden_size`, `eagle_config`, the top-level
  `eagle_aux_hidden_state_layer_ids` for vLLM, `norm_before_residual`, `fc_norm`, `norm_output`.

Tensors: `midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}.weight`, the Llama midlayer's norms and `mlp.{gate,up,down}_proj`, `fc`, `norm`, `lm_head`, `d2t`. vLLM maps
`midlayer.` to `layers.0.`, SGLang `layers.0.` to `midlayer.`: either prefix loads in both.
"""

from __future__ import annotations

from typing import Any

from eaglekit.drafters.eagle3.mla import ARCH, MLA_FIELDS
from eaglekit.drafters.eagle3.config import DrafterConfig
from eaglekit.errors import EaglekitError

ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM registers both names
MODEL_TYPE = "kimi_k2"
ATTENTION_TENSORS = tuple(f"self_attn.{name}.weight" for name in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
LAYER_TENSORS = (
    "input_layernorm.weight", "hidden_norm.weight", *ATTENTION_TENSORS, "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
ENGINES = ("vllm", "sglang")


def is_mla(config: DrafterConfig) -> bool:
    return config.drafter_arch == ARCH


def is_mla_checkpoint(data: dict[str, Any]) -> bool:
    """True for an engine config.json of the MLA drafter."""
    return any(a in ARCHITECTURES for a in data.get("architectures") or [])


def check_exportable(config: DrafterConfig, fmt: str) -> None:
    if fmt not in ENGINES:
        raise EaglekitError(f"the MLA drafter has no {fmt} layout (speculators has no MLA drafter); "
                            f"export it --to {' or --to '.join(ENGINES)}")
    if config.norm_before_fc:
        raise EaglekitError("neither engine's MLA drafter (Eagle3DeepseekV2ForCausalLM) has "
                            "norm_before_fc's input_norm: it would run without it. Train the MLA drafter with fc_norm "
                            "or without a norm before fc")


def config_fields(config: DrafterConfig, rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The DeepSeek-V3-schema part of config.json (the EAGLE-3 keys are added by `formats.engine_config`)."""
    return {
        "architectures": [ARCHITECTURES[0]],
        "model_type": MODEL_TYPE,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "num_hidden_layers": 1,
        **{name: getattr(config, name) for name in MLA_FIELDS},
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,  # SGLang reads it (default true); vLLM's MLA always rotates interleaved pairs
        "attention_bias": False,
        "tie_word_embeddings": False,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
    }


def drafter_fields(data: dict[str, Any]) -> dict[str, Any]:
    """DrafterConfig fields of an MLA checkpoint's config.json (`{}` for other drafters)."""
    if not is_mla_checkpoint(data):
        return {}
    missing = [name for name in MLA_FIELDS if not data.get(name)]
    if missing:
        raise EaglekitError(f"MLA drafter config lacks {missing} (both engines need them; SGLang needs q_lora_rank)")
    return {"drafter_arch": ARCH, **{name: int(data[name]) for name in MLA_FIELDS}}


def tensor_shapes(config: DrafterConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The shapes the engines' loaders build for the attention tensors."""
    h, heads = config.hidden_size, config.num_attention_heads
    qk, latent = config.qk_nope_head_dim + config.qk_rope_head_dim, config.kv_lora_rank
    shapes = {
        "q_a_proj": (config.q_lora_rank, 2 * h), "q_a_layernorm": (config.q_lora_rank,),
        "q_b_proj": (heads * qk, config.q_lora_rank),
        "kv_a_proj_with_mqa": (latent + config.qk_rope_head_dim, 2 * h), "kv_a_layernorm": (latent,),
        "kv_b_proj": (heads * (config.qk_nope_head_dim + config.v_head_dim), latent),
        "o_proj": (h, heads * config.v_head_dim),
    }
    return {f"{prefix}self_attn.{name}.weight": shape for name, shape in shapes.items()}


def engine_names(state: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """An MLA checkpoint's tensors under `midlayer.` (both engines also load the `layers.0.` prefix, which
    published drafters use); other checkpoints unchanged."""
    if not is_mla_checkpoint(data):
        return state
    prefix = "layers.0."
    return {f"midlayer.{name[len(prefix):]}" if name.startswith(prefix) else name: tensor for name,
            tensor in state.items()}
