"""The MLA midlayer (`drafter_arch="mla"`): EAGLE-3's single decoder layer with DeepSeek multi-head latent
attention, the drafter that DeepSeek-V3 / Kimi-K2 deployments serve (vLLM and SGLang architecture
`Eagle3DeepseekV2ForCausalLM`).

Layer (same residual structure as the Llama-style midlayer in `eaglekit.drafters.eagle3.model`):
    x = [input_layernorm(embedding), hidden_norm(feature)]                           (B, T, 2H)
    q = q_b_proj(q_a_layernorm(q_a_proj(x)))             per head [q_nope | q_rope]   (B, nh, T, Dn + R)
    [c | k_rope] = kv_a_proj_with_mqa(x)                 latent c (C), one rope key   (B, T, C + R)
    [k_nope | v] = kv_b_proj(kv_a_layernorm(c))          per head                    (B, nh, T, Dn + Dv)
    k = [k_nope | k_rope broadcast to every head]; RoPE on the rope slices only, DeepSeek's interleaved
    layout (pairs (2i, 2i+1) rotate together; vLLM's GPT-J style, equal in scores to transformers'
    permute-then-rotate), YaRN frequencies and mscale where `rope_parameters` say `yarn`;
    softmax scale (Dn + R) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN (as vLLM);
    out = o_proj(attention(q, k, v))                                                 (B, T, H)
then residual + MLP (SwiGLU `gate_proj`/`up_proj`/`down_proj`, dense: never MoE) as in the Llama midlayer.

Tensor names under `midlayer.self_attn.`: q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj (the checkpoint names both engines read; each engine fuses q_a_proj and kv_a_proj_with_mqa
into one projection when it loads them). `q_lora_rank` is required (SGLang's loader needs it).

Cache: the caller-owned key/value cache of the `Eagle3Drafter.forward` contract holds the DECOMPRESSED
per-head keys (B, nh, S, Dn + R) and values (B, nh, S, Dv), not the latent c. That is the simplest form that
keeps the contract (TTT and the eager decoder concatenate and mask them like any keys); the engines cache the
latent instead, which changes memory, not results.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from eaglekit.drafters.common import attend
from eaglekit.drafters.eagle3.config import DrafterConfig
from eaglekit.drafters.eagle3.layers import DraftDecoderLayer
from eaglekit.errors import EaglekitError

ARCH = "mla"
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROPE_TYPES = ("default", "yarn")


def check_mla_config(config: DrafterConfig) -> None:
    """Raise `EaglekitError` unless every MLA dimension is set and the RoPE type is one this layer implements."""
    missing = [name for name in MLA_FIELDS if not getattr(config, name)]
    if missing:
        raise EaglekitError(f"drafter_arch=mla needs {', '.join(missing)} > 0 (q_lora_rank is required: SGLang cannot "
                            "serve an MLA drafter without it); an MLA target's config provides them, else set them")
    if config.qk_rope_head_dim % 2:
        raise EaglekitError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise EaglekitError(f"the MLA drafter implements rope_type {' or '.join(ROPE_TYPES)}, the "
                            f"config has {rope_type!r}; set rope_parameters to one of those")


# --- RoPE -----------------------------------------------------------------------------------
def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(params: dict[str, Any], dim: int) -> torch.Tensor:
    """(dim/2,) fp32 YaRN frequencies: interpolated below the correction range, extrapolated above, a ramp between."""
    base, factor = float(params.get("rope_theta", 10000.0)), float(params["factor"])
    original = int(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (dim/2,)
    extrapolation = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    keep = 1 - ramp  # 1 = keep the original frequency
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def rope_scales(params: dict[str, Any]) -> tuple[float, float]:
    """(cos/sin magnitude, softmax-scale multiplier) for `rope_parameters`, as vLLM's DeepSeek attention applies them:
    YaRN multiplies cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) and the softmax scale by
    mscale(f, mscale_all_dim) ** 2 (the latter not when `attention_factor` is 1.0, vLLM's llama-scaling case)."""
    if params.get("rope_type", "default") == "default":
        return 1.0, 1.0
    factor = float(params["factor"])
    all_dim = yarn_mscale(factor, float(params.get("mscale_all_dim", 0) or 0))
    magnitude = yarn_mscale(factor, float(params.get("mscale", 1) or 0)) / all_dim
    return magnitude, 1.0 if params.get("attention_factor") == 1.0 else all_dim**2


class MLARotaryEmbedding(nn.Module):
    """cos/sin for the rope slice (R = qk_rope_head_dim) in the interleaved layout: (B, T, R), each frequency twice."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        params, dim = config.rope_parameters, config.qk_rope_head_dim
        if params.get("rope_type", "default") == "yarn":
            inverse = yarn_inverse_frequencies(params, dim)
        else:
            theta = float(params.get("rope_theta", 10000.0))
            inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        # a plain attribute, not a buffer: a model-wide .to(bfloat16) must not round the frequencies
        self.inverse_frequencies = inverse  # (R/2,) fp32
        self.magnitude = rope_scales(params)[0]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: any tensor of the compute dtype; position_ids (B, T) -> cos, sin (B, T, R) in x's dtype."""
        inverse = self.inverse_frequencies.to(position_ids.device)
        angles = position_ids[..., None].float() * inverse  # (B, T, R/2)
        angles = angles.repeat_interleave(2, dim=-1)  # (B, T, R): pair (2i, 2i+1) shares frequency i
        return (angles.cos() * self.magnitude).to(x.dtype), (angles.sin() * self.magnitude).to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin). x (..., R), cos/sin broadcastable."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., R/2, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)  # (..., R)
    return x * cos + rotated * sin


# --- attention and layer --------------------------------------------------------------------
class MLAAttention(nn.Module):
    """Multi-head latent attention whose two down-projections read the 2H-wide [norm(embedding), norm(feature)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        check_mla_config(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.value_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                                        config.v_head_dim)
        self.latent_dim = config.kv_lora_rank
        self.q_a_proj = nn.Linear(2 * h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = LlamaRMSNorm(config.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.latent_dim + self.rope_dim, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.latent_dim, eps=eps)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.value_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.value_dim, h, bias=False)
        # `attend` scales scores by (Dn + R) ** -0.5; YaRN's extra factor is folded into the query
        self.query_scale = rope_scales(config.rope_parameters)[1]

    def forward(
        self,
        x: torch.Tensor,  # (B, T, 2H)
        cos: torch.Tensor,  # (B, T, R)
        sin: torch.Tensor,  # (B, T, R)
        past_kv: tuple[torch.Tensor, torch.Tensor] | None,  # (B, nh, S, Dn + R), (B, nh, S, Dv)
        mask: Any,  # (B or 1, 1, T, S + T) bool, True = attend; a flex BlockMask; None = attend to all
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        nh, dn, r = self.num_heads, self.nope_dim, self.rope_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, T, nh*(Dn+R))
        q = q.view(b, t, nh, dn + r).transpose(1, 2)  # (B, nh, T, Dn+R)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent_dim, r], dim=-1)  # (B, T, C), (B, T, R)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # (B, T, nh*(Dn+Dv))
        kv = kv.view(b, t, nh, dn + self.value_dim).transpose(1, 2)  # (B, nh, T, Dn+Dv)
        k_nope, v = kv.split([dn, self.value_dim], dim=-1)  # (B, nh, T, Dn), (B, nh, T, Dv)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R)
        q_rope = rotate_interleaved(q[..., dn:], cos, sin)  # (B, nh, T, R)
        k_rope = rotate_interleaved(k_rope[:, None], cos, sin)  # (B, 1, T, R): one rope key shared by all heads
        q = torch.cat([q[..., :dn], q_rope], dim=-1)  # (B, nh, T, Dn+R)
        k = torch.cat([k_nope, k_rope.expand(b, nh, t, r)], dim=-1)  # (B, nh, T, Dn+R)
        keys, values = (k, v) if past_kv is None else (torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2))
        scaled_q = q if self.query_scale == 1.0 else q * self.query_scale
        out = attend(scaled_q, keys, values, mask, enable_gqa=False)  # (B, nh, T, Dv)
        out = out.transpose(1, 2).reshape(b, t, nh * self.value_dim)  # (B, T, nh*Dv)
        return self.o_proj(out), (k, v)


class MLADecoderLayer(DraftDecoderLayer):
    """The `midlayer` with MLA attention. `forward` (norms, residual, MLP) is the Llama midlayer's own, so both
    architectures share one definition of the layer around the attention."""

    def __init__(self, config: DrafterConfig):
        nn.Module.__init__(self)  # not DraftDecoderLayer.__init__: that builds the Llama q/k/v attention
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = MLAAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        # the SwiGLU alone: a LlamaConfig of the MLP's fields (the full one would re-validate the MLA RoPE settings)
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=config.intermediate_size,
                                        hidden_act=config.hidden_act))

    @staticmethod
    def rotary_embedding(config: DrafterConfig) -> nn.Module:
        return MLARotaryEmbedding(config)


# --- dimensions from a target ---------------------------------------------------------------
def mla_dims(text_config: Any) -> dict[str, int] | None:
    """The MLA dimensions of an MLA target's config (DeepSeek-V2/V3, Kimi-K2), or None for other targets."""
    values = {name: getattr(text_config, name, None) for name in MLA_FIELDS}
    if not all(values[name] for name in MLA_FIELDS if name != "q_lora_rank"):
        return None
    return {name: int(value) if value else 0 for name, value in values.items()}


def architecture_fields(options: Any, text_config: Any) -> dict[str, Any]:
    """DrafterConfig fields for a fresh drafter of `options.drafter_arch` (`eaglekit train drafter_arch=mla`): {} for
    llama; for mla each MLA dimension from the option when set (> 0), else from the target's own MLA config."""
    arch = getattr(options, "drafter_arch", "llama") or "llama"
    if arch != ARCH:
        return {}
    target = mla_dims(text_config) or {}
    dims = {name: int(getattr(options, name, 0) or target.get(name, 0)) for name in MLA_FIELDS}
    missing = [name for name, value in dims.items() if not value]
    if missing:
        raise EaglekitError(f"drafter_arch=mla: the target has no MLA config to take {', '.join(missing)} from; set "
                            f"{' '.join(f'{name}=N' for name in missing)} (DeepSeek-V3: "
                            "q_lora_rank=1536 kv_lora_rank=512 qk_nope_head_dim=128 "
                            "qk_rope_head_dim=64 v_head_dim=128)")
    return {"drafter_arch": ARCH, **dims}


def check_init_from(options: Any, config: DrafterConfig, source: str) -> None:
    """Fine-tuning keeps the drafter's midlayer: asking for mla on a drafter of another architecture is refused."""
    if getattr(options, "drafter_arch", "llama") == ARCH and config.drafter_arch != ARCH:
        raise EaglekitError(f"drafter_arch=mla: init_from={source} is a {config.drafter_arch} drafter, "
                            "and fine-tuning keeps its architecture; drop drafter_arch=, or train a fresh MLA "
                            "drafter without init_from")
