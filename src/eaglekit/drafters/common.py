"""What every drafter type shares: attention (SDPA, or flex attention for block masks), the draft vocabulary and
the target's embedding and lm_head rows (`DraftVocabulary`, for any module with `d2t`/`t2d` buffers, `embed_tokens`
and `lm_head`), and the files of a saved eaglekit drafter (config.json + model.safetensors)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eaglekit.errors import EaglekitError


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


class DraftVocabulary:
    """The draft vocabulary of a drafter module (buffers `d2t` (Vd,) offsets and `t2d` (V,) bool; `config` with
    `vocab_size`, `draft_vocab_size`) and the target's rows it reads: the frozen `embed_tokens`, `lm_head`."""

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

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def rope_parameters(text_config: Any) -> dict[str, Any]:
    """RoPE settings of a target config, as a transformers-5 `rope_parameters` dict."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "full_attention" in params:  # per-layer-type settings (Gemma 3 style)
            params = params["full_attention"]
        return dict(params)
    scaling = dict(getattr(text_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": float(getattr(text_config, "rope_theta", 10000.0))}


def target_shape(text_config: Any, target_name: str, architecture: str) -> dict[str, Any]:
    """Config fields of a drafter shaped like one layer of the target (hidden, heads, MLP width, RoPE, vocabulary),
    and the target it is made for: what every drafter type's fresh config starts from."""
    hidden = int(text_config.hidden_size)
    heads = int(text_config.num_attention_heads)
    return {"hidden_size": hidden, "intermediate_size": int(text_config.intermediate_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text_config, "num_key_value_heads", None) or heads),
            "vocab_size": int(text_config.vocab_size), "target_hidden_size": hidden,
            "head_dim": getattr(text_config, "head_dim", None) or hidden // heads,
            "rms_norm_eps": float(getattr(text_config, "rms_norm_eps", 1e-6)),
            "rope_parameters": rope_parameters(text_config),
            "max_position_embeddings": int(getattr(text_config, "max_position_embeddings", 4096)),
            "target_name_or_path": target_name, "target_architecture": architecture,
            "target_num_layers": int(text_config.num_hidden_layers)}


def normal_init(drafter: nn.Module, std: float) -> None:
    """Every linear layer's weight drawn from N(0, std) (Hugging Face's `_init_weights`, which speculators and
    SpecForge drafters get, at std = 0.02), instead of torch's default (uniform, std 1/sqrt(3 fan_in))."""
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)


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
