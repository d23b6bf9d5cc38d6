"""The EAGLE-3 drafter's config: shape, variant flags and the target it was made for (saved as config.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig

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
    target_weights_hash: str = ""  # eaglekit.targets.identity.target_weights_hash of the target it was trained on
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
