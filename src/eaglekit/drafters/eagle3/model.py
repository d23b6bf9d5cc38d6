"""The EAGLE-3 drafter: `fc` fusion of three target hidden states, one decoder layer with a 2H-wide
attention input, `norm` and an `lm_head` over the draft vocabulary.

Tensor names match the EAGLE / SGLang / vLLM "eagle3" layout (`midlayer.*`, `fc.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, `embed_tokens.weight`), so export is a key map.

One call of `Eagle3Drafter.forward` is one drafting step over T positions. The caller owns the
key/value cache: it passes earlier keys/values and a boolean attention mask, and receives the new
keys/values of this step. Training-time test, chain and tree decoding all build on that one call.

Vocabulary encoding: `d2t[i]` is an OFFSET, `target_id = draft_id + d2t[draft_id]`; `t2d` is a
boolean mask over the target vocabulary, True for ids the draft vocabulary keeps.

Variants (config fields and tensor names as vLLM's `llama_eagle3.py` and speculators name them):
- `norm_before_fc`: `fuse` = fc(input_norm(aux)), one RMSNorm `input_norm.weight` (k*H_t) over the
  concatenated aux states (speculators' default for eagle3).
- `fc_norm` (EAGLE 3.1): `fuse` = fc(cat_i fc_norm_i(aux_i)), one RMSNorm `fc_norm.{i}.weight` (H_t) per aux
  chunk, in aux-layer order. Exclusive with `norm_before_fc`.
- `norm_output` (EAGLE 3.1): the hidden state a step hands to the next step is norm(h), the same tensor the
  lm_head reads, instead of the pre-norm h (vLLM: the model returns `(norm(h), norm(h))` instead of
  `(norm(h), h)`, and its proposer feeds the second back). `Eagle3Drafter.head` is that rule.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eaglekit.errors import EaglekitError
from eaglekit.layers import INPUT_OF_LAYER, OUTPUT_OF_LAYER

FORMAT = "eaglekit-eagle3"


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and identity of a drafter. `aux_layer_ids` always use `aux_layer_convention`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    head_dim: int | None = None
    aux_layer_convention: str = INPUT_OF_LAYER
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # speculators option: residual taken after hidden_norm
    drafter_arch: str = "llama"  # midlayer architecture: "llama" (this file) or another registered in MIDLAYERS
    norm_before_fc: bool = False  # one RMSNorm `input_norm` (k*H_target) over the concatenated aux before `fc`
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm `fc_norm.{i}` (H_target) per aux chunk before `fc`
    norm_output: bool = False  # EAGLE 3.1: the next drafting step gets the post-`norm` hidden state
    # drafter_arch="mla" only (eaglekit.drafters.eagle3.mla; DeepSeek's names): latent ranks and per-head dims
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    target_name_or_path: str = ""
    target_architecture: str = ""
    target_num_layers: int = 0
    # "eagle3", or "p-eagle" (eaglekit.drafters.p_eagle.train): parallel drafting, a learned `mask_hidden`
    # (1, n_aux*H_target)
    # and `mask_token_id` (the parallel-drafting token) at every drafted position after the first
    drafter_type: str = "eagle3"
    mask_token_id: int = -1

    def __post_init__(self) -> None:
        if self.aux_layer_convention not in (INPUT_OF_LAYER, OUTPUT_OF_LAYER):
            raise EaglekitError(f"aux_layer_convention must be '{INPUT_OF_LAYER}' or '{OUTPUT_OF_LAYER}'")
        if self.draft_vocab_size > self.vocab_size:
            raise EaglekitError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target "
                                f"vocabulary {self.vocab_size}")
        if len(self.aux_layer_ids) != 3:
            raise EaglekitError(f"EAGLE-3 fuses exactly 3 target layers, got aux_layer_ids={self.aux_layer_ids}")
        if self.fc_norm and self.norm_before_fc:
            raise EaglekitError("fc_norm and norm_before_fc are mutually exclusive (one norm per "
                                "aux chunk, or one over their concatenation): set one of them to false")
        if self.drafter_type not in ("eagle3", "p-eagle"):
            raise EaglekitError(f"an EAGLE-3 drafter's drafter_type is eagle3 or p-eagle, not {self.drafter_type!r}")
        if self.drafter_type == "p-eagle" and not 0 <= self.mask_token_id < self.vocab_size:
            raise EaglekitError(f"a p-eagle drafter needs its parallel-drafting token id in [0, {self.vocab_size}), "
                                f"got mask_token_id={self.mask_token_id}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def llama_config(self) -> LlamaConfig:
        """The LlamaConfig equivalent, for RoPE and the MLP/norm modules borrowed from transformers."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.resolved_head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            num_hidden_layers=1,
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["aux_layer_ids"] = list(self.aux_layer_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"format", "architectures"}
        if unknown:
            raise EaglekitError(f"drafter config has unknown keys {sorted(unknown)}; is it an eaglekit drafter? (use "
                                "`eaglekit import` for other formats)")
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["aux_layer_ids"] = tuple(kwargs["aux_layer_ids"])
        return cls(**kwargs)


@functools.cache
def compiled_flex_attention(backend: str | Any = "inductor") -> Any:
    """flex_attention compiled once for every shape.

    `dynamic=None` is torch.compile's automatic dynamic shapes: the first call compiles for its shapes, and the
    first call with another length recompiles once with symbolic lengths. `dynamic=False` compiled every new
    (T, S) anew: TTT alone gives K key lengths per T, and varying T hit the recompile limit (8), after which
    every call ran eager flex (orders of magnitude slower). Training also pads T to a multiple of
    `pad_to_multiple`, so the lengths seen are few (docs/train.md).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None, backend=backend)


def attend(
    q: torch.Tensor,  # (B, nh, T, D)
    keys: torch.Tensor,  # (B, nkv, S, D)
    values: torch.Tensor,  # (B, nkv, S, D)
    mask: Any,  # bool tensor (B or 1, 1, T, S), True = attend; a flex-attention BlockMask; or None
    enable_gqa: bool,
) -> torch.Tensor:
    """Scaled dot-product attention; a `BlockMask` selects flex attention (compiled on CUDA)."""
    if mask is None or isinstance(mask, torch.Tensor):
        if enable_gqa and mask is not None and q.device.type == "cuda":
            # the masked (memory-efficient) CUDA kernel may lack GQA, and the math fallback materialises
            # every score: expand the key/value heads instead
            group = q.shape[1] // keys.shape[1]
            keys, values, enable_gqa = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), False
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    # eager flex attention is a slow reference; the CUDA kernel needs compile
    function = compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return function(q, keys, values, block_mask=mask, enable_gqa=enable_gqa)


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


MIDLAYERS: dict[str, Any] = {"llama": DraftDecoderLayer}  # drafter_arch -> midlayer class (config) -> module


def midlayer_class(config: DrafterConfig) -> Any:
    """The midlayer class for `config.drafter_arch` ("mla" registers itself from eaglekit.drafters.eagle3.mla)."""
    if config.drafter_arch not in MIDLAYERS:
        raise EaglekitError(f"drafter_arch={config.drafter_arch!r} is not known; choose one of {sorted(MIDLAYERS)}")
    return MIDLAYERS[config.drafter_arch]


def build_midlayer(config: DrafterConfig) -> nn.Module:
    """The drafter's single decoder layer for `config.drafter_arch`."""
    return midlayer_class(config)(config)


def build_rotary(config: DrafterConfig) -> nn.Module:
    """The RoPE module of `config.drafter_arch`'s midlayer: position ids (B, T) -> (cos, sin)."""
    return midlayer_class(config).rotary_embedding(config)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model. See the module docstring for the step contract."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        num_aux, target_h = len(config.aux_layer_ids), config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(num_aux * target_h, eps=config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(target_h, eps=config.rms_norm_eps) for _ in range(num_aux)])
        self.fc = nn.Linear(num_aux * target_h, h, bias=False)
        self.midlayer = build_midlayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = build_rotary(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if config.drafter_type == "p-eagle":  # in fc's input space, as vLLM's `mask_hidden` buffer
            self.mask_hidden = nn.Parameter(torch.zeros(1, num_aux * target_h))

    # --- vocabulary -------------------------------------------------------------------------
    def set_vocab_mapping(self, used_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: `used_ids` (Vd,) target ids, sorted ascending."""
        used_ids = used_ids.to(torch.long).cpu()
        if used_ids.numel() != self.config.draft_vocab_size:
            raise EaglekitError(f"vocab mapping has {used_ids.numel()} ids, drafter expects "
                                f"{self.config.draft_vocab_size}")
        if not bool((used_ids[1:] > used_ids[:-1]).all()):
            raise EaglekitError("draft vocabulary ids must be unique and sorted ascending")
        self.d2t.copy_(used_ids - torch.arange(used_ids.numel()))
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[used_ids] = True
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (`d2t` holds offsets)."""
        return draft_ids + self.d2t[draft_ids]

    # --- forward ----------------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 3*H_target) concatenated low/mid/high target states -> (B, T, H) feature."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)  # one RMSNorm over all 3*H_target features
        elif self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)  # 3 x (B, T, H_target)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def mask_feature(self) -> torch.Tensor:
        """p-eagle: (1, H) the feature every drafted position after the first reads, `fuse(mask_hidden)` (vLLM
        passes `mask_hidden` through the same norms and fc as the target's states)."""
        return self.fuse(self.mask_hidden)

    def head(self, hidden_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) midlayer output -> (the hidden state the next step gets (B, T, H), draft logits (B, T, Vd)).
        The logits read norm(h); the next step gets norm(h) with `norm_output`, else h."""
        normed = self.norm(hidden_out)
        return (normed if self.config.norm_output else hidden_out), self.lm_head(normed)

    def forward(
        self,
        hidden: torch.Tensor,  # (B, T, H) fused feature (step 0) or previous step's output hidden
        input_ids: torch.Tensor,  # (B, T) target-vocab ids of the NEXT token at each position
        position_ids: torch.Tensor,  # (B, T)
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # 2 x (B, nkv, S, D)
        mask: torch.Tensor | None = None,  # (B or 1, 1, T, S + T) bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One drafting step -> (hidden for the next step (B, T, H) (see `head`), draft logits (B, T, Vd), this
        step's (k, v))."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rotary_emb(hidden, position_ids)
        hidden_out, new_kv = self.midlayer(embeds, hidden, cos, sin, past_kv, mask)
        hidden_next, logits = self.head(hidden_out)  # (B, T, H), (B, T, Vd)
        return hidden_next, logits, new_kv

    # --- persistence ------------------------------------------------------------------------
    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding (V, H) into the frozen `embed_tokens`."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise EaglekitError(
                f"target embedding has shape {tuple(weight.shape)}, drafter expects "
                f"{tuple(self.embed_tokens.weight.shape)}: the drafter was made for another target (vocab "
                "or hidden size differ)"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    def load_target_lm_head(self, weight: torch.Tensor) -> None:
        """Set `lm_head` to the target's lm_head (V, H) rows of the draft vocabulary (`set_vocab_mapping` first)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.lm_head.weight.shape[1]):
            raise EaglekitError(f"target lm_head has shape {tuple(weight.shape)}, drafter expects "
                                f"({self.config.vocab_size}, {self.lm_head.weight.shape[1]}): the drafter was "
                                "made for another target")
        used_ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(weight[used_ids.to(weight.device)].to(self.lm_head.weight))

    def save_pretrained(self, directory: str | Path, include_embedding: bool = True) -> Path:
        """Write `config.json` + `model.safetensors` (eaglekit format), atomically."""
        return save_drafter_files(self, directory, include_embedding,
                                  {"format": FORMAT, "architectures": ["Eagle3Drafter"], **self.config.to_dict()})

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> Eagle3Drafter:
        """Load an eaglekit-format drafter. A missing `embed_tokens.weight` stays zero: call `load_target_embedding`."""
        directory = Path(directory)
        config_path, weights_path, data = read_drafter_config(
            directory, "use `eaglekit import` for EAGLE, SGLang, vLLM or speculators checkpoints")
        if data.get("format") != FORMAT:
            raise EaglekitError(f"{config_path} is not in eaglekit format; convert it with `eaglekit import "
                                f"--source {directory}`")
        config = DrafterConfig.from_dict(data)
        with torch.device("meta"):
            model = cls(config)
        state = read_drafter_state(weights_path, "re-run the stage that wrote it, or copy the drafter again")
        missing = set(model.state_dict()) - set(state) - {"embed_tokens.weight"}
        unexpected = set(state) - set(model.state_dict())
        if missing or unexpected:
            raise EaglekitError(f"{weights_path}: missing tensors {sorted(missing)}, unexpected tensors "
                                f"{sorted(unexpected)}")
        if "embed_tokens.weight" not in state:
            state["embed_tokens.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
        model.load_state_dict(state, assign=True, strict=True)
        model.rotary_emb = build_rotary(config)  # non-persistent buffers
        model.embed_tokens.weight.requires_grad_(False)
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


# --- the eaglekit drafter files (config.json + model.safetensors), shared by every drafter type --------------
def save_drafter_files(drafter: nn.Module, directory: str | Path, include_embedding: bool,
                       config: dict[str, Any]) -> Path:
    """Write `drafter`'s weights (tagged with `config["format"]`) and `config` under `directory`, atomically."""
    from eaglekit.manifest import atomic_path, atomic_write_json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if not include_embedding:
        state.pop("embed_tokens.weight")
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": config["format"]})
    atomic_write_json(directory / "config.json", config)
    return directory


def read_drafter_config(directory: Path, import_hint: str) -> tuple[Path, Path, dict[str, Any]]:
    """(config path, weights path, the parsed config.json) of a saved drafter; refuses missing files naming
    `import_hint` (how to bring another layout in) and a config.json that is not JSON."""
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise EaglekitError(f"{directory} is not an eaglekit drafter (needs config.json and model.safetensors); "
                            f"{import_hint}")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise EaglekitError(f"{config_path} is not valid JSON ({error}); re-run the stage that wrote it") from None
    return config_path, weights_path, data


def read_drafter_state(weights_path: Path, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a saved drafter's model.safetensors; a damaged file is refused naming `fix`."""
    try:
        return load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise EaglekitError(f"{weights_path} is damaged or not a safetensors file ({error}); {fix}") from None
