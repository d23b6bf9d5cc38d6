"""Stable identities of a target and its tokenizer, so stored hidden states and drafters are never paired with
the wrong model: `target_config_hash(config)`, `tokenizer_hash(tokenizer)` and `target_weights_hash(embedding,
lm_head)` (16 hex digits each).

Only what changes the numbers is hashed: the architecture-defining config fields (not the
transformers version, the local path or the load dtype), the tokenizer's vocabulary, special
tokens and chat template (not its class or file layout), and a sample of the weights (not their dtype).
"""

from __future__ import annotations

from typing import Any

from eaglekit.manifest import data_hash

# Config keys that say how a checkpoint was saved or loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "use_cache", "output_hidden_states", "output_attentions",
    "return_dict", "_commit_hash", "_experts_implementation",
})


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value


def target_config_hash(config: Any) -> str:
    """Hash of an HF config (object or dict) over the fields that define the computation."""
    data = config if isinstance(config, dict) else config.to_dict()
    return data_hash(_strip(data))


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of what maps text to ids: vocabulary (token -> id), special tokens, chat template."""
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None)
    special = {
        "bos": getattr(tokenizer, "bos_token", None),
        "eos": getattr(tokenizer, "eos_token", None),
        "pad": getattr(tokenizer, "pad_token", None),
        "unk": getattr(tokenizer, "unk_token", None),
        "added": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
    }
    ordered = sorted(vocab.items(), key=lambda item: item[1])
    return data_hash({"vocab": ordered, "special": special, "template": template})


WEIGHT_ROWS = 64  # rows of the embedding and of the lm_head that `target_weights_hash` reads


def target_weights_hash(embedding: Any, lm_head: Any) -> str:
    """Fingerprint of a target's weights: WEIGHT_ROWS rows spread evenly over the vocabulary of its input embedding
    (V, H) and its lm_head (V, H), rounded to bf16, so the target read from its checkpoint (offline training) or
    loaded in fp32 or bf16 (online training, decoding) gives the same. Two targets of the same shape with other
    weights (a base model and its fine-tune) differ in it. "" when the weights are not in memory (meta tensors)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for weight in (embedding, lm_head):
        if weight is None or weight.is_meta:
            return ""
        rows = torch.linspace(0, weight.shape[0] - 1, min(WEIGHT_ROWS, weight.shape[0])).round().long()
        sample = weight.detach().index_select(0, rows.to(weight.device)).to("cpu", torch.bfloat16).contiguous()
        digest.update(str(tuple(weight.shape)).encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
