"""The DFlash drafter (block diffusion drafting): a small stack of Qwen3-style decoder layers that denoises a block
of mask tokens in ONE non-causal forward, conditioned on the target's hidden states injected as keys/values.

The model, exactly as vLLM 0.32 serves it (`DFlashDraftModel`, vllm/model_executor/models/qwen3_dflash.py):
- context: the target states of `target_layer_ids` (OUTPUT-of-layer ids: id i is the output of decoder layer i, the
  state entering layer i + 1) concatenated, c = hidden_norm(fc(aux)) (T, H). Every layer l projects the SAME c to its
  context keys/values: k = rope(k_norm(k_proj_l(c))), v = v_proj_l(c), at the context tokens' own positions. The
  context never runs through the layers.
- query: [bonus token, mask, ..., mask] (1 + k tokens; `mask_token_id`'s row of the frozen target embedding) at
  positions m .. m + k, where m is the number of context tokens. Each layer is a Qwen3 pre-norm layer (per-head
  RMSNorm `q_norm`/`k_norm` before RoPE, SwiGLU MLP); the queries attend to all context keys and to every query of
  the block (non-causal). norm, then `lm_head` over the draft vocabulary (`d2t` offsets, as EAGLE-3).
- the output at block position j (1..k) is the draft of the token AT position m + j; the bonus position's output is
  unused.

Tensor names are vLLM's checkpoint names (`fc.weight`, `hidden_norm.weight`, `layers.{i}.self_attn.q_proj.weight`,
`layers.{i}.self_attn.q_norm.weight`, ..., `norm.weight`, `lm_head.weight`, `d2t`), so export is a key filter.
`embed_tokens` is the target's embedding, frozen (not exported: vLLM shares the target's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from eaglekit.drafters.common import (
    DraftVocabulary,
    attend,
    read_drafter_config,
    read_drafter_state,
    save_drafter_files,
)
from eaglekit.errors import EaglekitError
from eaglekit.layers import OUTPUT_OF_LAYER

FORMAT = "eaglekit-dflash"
DRAFTER_TYPE = "dflash"
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DFlashConfig:
    """Shape and identity of a DFlash drafter. `target_layer_ids` are output-of-layer ids (vLLM's DFlash convention)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int  # drafter layers
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE  # trained block: the bonus token + block_size - 1 mask tokens
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target_name_or_path: str = ""
    target_architecture: str = ""
    target_num_layers: int = 0
    target_weights_hash: str = ""  # eaglekit.targets.identity.target_weights_hash of the target it was trained on

    def __post_init__(self) -> None:
        if self.draft_vocab_size > self.vocab_size:
            raise EaglekitError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary "
                                f"{self.vocab_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise EaglekitError(f"target_layer_ids={list(self.target_layer_ids)}: DFlash needs at least one target "
                                "layer, as output-of-layer ids >= 0")
        if self.block_size < 2:
            raise EaglekitError(f"block_size={self.block_size}: a block holds the bonus token and at least one mask "
                                "token (>= 2; 16 is the published default)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise EaglekitError(f"mask_token_id={self.mask_token_id} is outside the target vocabulary "
                                f"(0..{self.vocab_size - 1})")
        if self.num_hidden_layers < 1:
            raise EaglekitError(f"a DFlash drafter needs at least one layer, got num_hidden_layers="
                                f"{self.num_hidden_layers}")

    # the capture hooks and the decoders read every drafter's layers through these two names
    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.target_layer_ids)

    @property
    def aux_layer_convention(self) -> str:
        return OUTPUT_OF_LAYER

    @property
    def drafter_type(self) -> str:
        return DRAFTER_TYPE

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def llama_config(self) -> LlamaConfig:
        """The LlamaConfig equivalent, for RoPE and the MLP borrowed from transformers."""
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.resolved_head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters=dict(self.rope_parameters),
                           max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
                           num_hidden_layers=self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"format", "architectures", "drafter_type"}
        if unknown:
            raise EaglekitError(f"DFlash drafter config has unknown keys {sorted(unknown)}; is it an eaglekit DFlash "
                                "drafter? (use `eaglekit import` for other layouts)")
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["target_layer_ids"] = tuple(kwargs["target_layer_ids"])
        return cls(**kwargs)


def check_block(num_drafts: int, block_size: int) -> None:
    """Refuse more drafts per step than the drafter's block was trained for (eaglekit's decoder and vLLM alike)."""
    if num_drafts > block_size - 1:
        raise EaglekitError(f"chain_length={num_drafts} drafts more tokens than this DFlash drafter's block holds "
                            f"(block_size {block_size}: at most {block_size - 1}); lower chain_length")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Output-of-layer ids spread evenly from layer 1 to layer L-3 (the published DFlash recipe), one per drafter
    layer; the middle layer for a one-layer drafter. Distinct and in range on any target of 2 layers or more."""
    if num_target_layers < 2:
        raise EaglekitError(f"a {num_target_layers}-layer target is too small for DFlash: pass target_layer_ids")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(1, num_target_layers - 3)
    ids = sorted({round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)})
    return tuple(min(i, num_target_layers - 1) for i in ids)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm before RoPE) over [context keys, block keys]."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def project_kv(
        self,
        x: torch.Tensor,  # (B, T, H)
        cos: torch.Tensor,  # (B, T, D)
        sin: torch.Tensor,  # (B, T, D)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys (B, nkv, T, D) (k_norm, RoPE), values (B, nkv, T, D)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # (B, nkv, T, D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        return rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, Q, H) -> queries (B, nh, Q, D) (q_norm, RoPE)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)  # (B, nh, Q, D)
        return rope(q, cos, sin)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output (B, nh, Q, D) -> (B, Q, H)."""
        b, _, q_len, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # (B, Q, H) block tokens
        cos: torch.Tensor,  # (B, Q, D)
        sin: torch.Tensor,  # (B, Q, D)
        context: tuple[torch.Tensor, torch.Tensor],  # keys, values (B, nkv, S, D) of the context
        mask: Any,  # (B or 1, 1, Q, S + Q) bool, True = attend; a flex BlockMask; None = attend to all
    ) -> torch.Tensor:
        q = self.project_q(x, cos, sin)  # (B, nh, Q, D)
        k, v = self.project_kv(x, cos, sin)  # (B, nkv, Q, D) each
        keys, values = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)  # (B, nkv, S + Q, D)
        return self.output(attend(q, keys, values, mask, enable_gqa=self.num_heads != self.num_kv_heads))  # (B, Q, H)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, D) rotated by cos, sin (B, T, D): the neox layout (halves rotate together), vLLM's default."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DFlashLayer(nn.Module):
    """A Qwen3 pre-norm decoder layer whose attention also reads the context keys/values."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        """x (B, Q, H) -> (B, Q, H)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(DraftVocabulary, nn.Module):
    """DFlash draft model. See the module docstring; `context` then `forward` is one drafting step."""

    FORMAT = FORMAT  # the `format` of its saved config.json
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def context(
        self,
        aux: torch.Tensor,  # (B, T, n_aux * H_target) target states of target_layer_ids, concatenated
        position_ids: torch.Tensor,  # (B, T) their positions
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context keys/values of every layer: [(keys, values) (B, nkv, T, D)] * num_layers."""
        states = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # (B, T, H)
        cos, sin = self.rotary_emb(states, position_ids)  # (B, T, D) each
        return [layer.self_attn.project_kv(states, cos, sin) for layer in self.layers]

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (B, Q) block tokens: the bonus (anchor) token, then mask tokens
        position_ids: torch.Tensor,  # (B, Q)
        context: list[tuple[torch.Tensor, torch.Tensor]],  # per layer keys, values (B, nkv, S, D)
        mask: Any = None,  # (B or 1, 1, Q, S + Q) bool, True = attend; flex BlockMask; None = attend to all
    ) -> torch.Tensor:
        """-> the block's final hidden states (B, Q, H), after `norm`: what `lm_head` reads."""
        x = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # (B, Q, H)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer, layer_context in zip(self.layers, context):
            x = layer(x, cos, sin, layer_context, mask)
        return self.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, Q) block tokens: the bonus (anchor) token, then mask tokens
        position_ids: torch.Tensor,  # (B, Q)
        context: list[tuple[torch.Tensor, torch.Tensor]],  # per layer keys, values (B, nkv, S, D)
        mask: Any = None,  # (B or 1, 1, Q, S + Q) bool, True = attend; flex BlockMask; None = attend to all
    ) -> torch.Tensor:
        """-> draft logits (B, Q, Vd); position j > 0 drafts the token at position_ids[:, j]."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, context, mask))  # (B, Q, Vd)

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (the rest goes with the objective that wraps the drafter)."""
        return list(self.layers)

    # --- persistence ------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, include_embedding: bool = True) -> Path:
        """Write `config.json` + `model.safetensors` (eaglekit DFlash format), atomically."""
        return save_drafter_files(self, directory, include_embedding,
                                  {"format": self.FORMAT, "drafter_type": self.config.drafter_type,
                                   "architectures": [type(self).__name__], **self.config.to_dict()})

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> DFlashDrafter:
        """Load an eaglekit DFlash drafter. A missing `embed_tokens.weight` stays zero: call `load_target_embedding`."""
        directory = Path(directory)
        config_path, weights_path, data = read_drafter_config(directory,
                                                              "use `eaglekit import` for vLLM's DFlash layout")
        if data.get("format") != cls.FORMAT:
            raise EaglekitError(f"{config_path} is not an eaglekit {cls.config_class.__name__[:-6]} drafter; convert "
                                f"it with `eaglekit import --source {directory}`")
        config = cls.config_class.from_dict(data)
        state = read_drafter_state(weights_path, "re-run the stage that wrote it")
        return build_from_state(config, state, str(weights_path), cls).to(device=device, dtype=dtype)


def build_from_state(config: DFlashConfig, state: dict[str, torch.Tensor], source: str,
                     cls: type | None = None) -> DFlashDrafter:
    """A drafter of class `cls` (default `DFlashDrafter`) and `config` holding `state` (eaglekit names;
    `embed_tokens.weight` may be missing: zeros)."""
    with torch.device("meta"):
        model = (cls or DFlashDrafter)(config)
    missing = set(model.state_dict()) - set(state) - {"embed_tokens.weight"}
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise EaglekitError(f"{source}: missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}")
    state = dict(state)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary_emb = LlamaRotaryEmbedding(config.llama_config())  # non-persistent buffers
    model.embed_tokens.weight.requires_grad_(False)
    return model
