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

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eaglekit.drafters.common import DraftVocabulary, read_drafter_config, read_drafter_state, save_drafter_files
from eaglekit.drafters.eagle3.config import FORMAT, DrafterConfig
from eaglekit.drafters.eagle3.layers import DraftDecoderLayer
from eaglekit.drafters.eagle3.mla import MLADecoderLayer
from eaglekit.errors import EaglekitError

# drafter_arch -> midlayer class (config) -> module; each has `rotary_embedding(config)`
MIDLAYERS: dict[str, Any] = {"llama": DraftDecoderLayer, "mla": MLADecoderLayer}


def midlayer_class(config: DrafterConfig) -> Any:
    """The midlayer class for `config.drafter_arch`."""
    if config.drafter_arch not in MIDLAYERS:
        raise EaglekitError(f"drafter_arch={config.drafter_arch!r} is not known; choose one of {sorted(MIDLAYERS)}")
    return MIDLAYERS[config.drafter_arch]


def build_midlayer(config: DrafterConfig) -> nn.Module:
    """The drafter's single decoder layer for `config.drafter_arch`."""
    return midlayer_class(config)(config)


def build_rotary(config: DrafterConfig) -> nn.Module:
    """The RoPE module of `config.drafter_arch`'s midlayer: position ids (B, T) -> (cos, sin)."""
    return midlayer_class(config).rotary_embedding(config)


class Eagle3Drafter(DraftVocabulary, nn.Module):
    """EAGLE-3 draft model. See the module docstring for the step contract."""

    config_class = DrafterConfig

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

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (the rest goes with the objective that wraps the drafter)."""
        return [self.midlayer]

    # --- persistence ------------------------------------------------------------------------
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



# --- the eaglekit drafter files (config.json + model.safetensors), shared by every drafter type --------------


