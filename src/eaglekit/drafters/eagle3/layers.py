"""The EAGLE-3 drafter's Llama-style midlayer: one decoder layer whose attention reads [norm(embedding),
norm(feature)] (2H wide), the residual being the fused feature."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eaglekit.drafters.common import attend
from eaglekit.drafters.eagle3.config import DrafterConfig


class DraftAttention(nn.Module):
    """Attention whose q/k/v read the 2H-wide concatenation [norm(embedding), norm(feature)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, 2H)
        cos: torch.Tensor,  # (B, T, D)
        sin: torch.Tensor,  # (B, T, D)
        past_kv: tuple[torch.Tensor, torch.Tensor] | None,  # 2 x (B, nkv, S, D)
        mask: Any,  # (B or 1, 1, T, S + T) bool, True = attend; a flex BlockMask; None = attend to all
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = (k, v) if past_kv is None else (torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2))
        out = attend(q, keys, values, mask, enable_gqa=self.num_heads != self.num_kv_heads)  # (B, nh, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, nh*D)
        return self.o_proj(out), (k, v)


class DraftDecoderLayer(nn.Module):
    """The single `midlayer`: residual is the fused feature, attention sees [emb, feature]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        llama = config.llama_config()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    @staticmethod
    def rotary_embedding(config: DrafterConfig) -> nn.Module:
        """The module that turns position ids into the (cos, sin) this layer's attention takes."""
        return LlamaRotaryEmbedding(config.llama_config())

    def forward(
        self,
        embeds: torch.Tensor,  # (B, T, H) embedding of the next token
        hidden: torch.Tensor,  # (B, T, H) fused target feature, or the previous step's output
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # (B, T, 2H)
        attn, new_kv = self.self_attn(x, cos, sin, past_kv, mask)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, new_kv
