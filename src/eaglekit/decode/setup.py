"""Loading what the decode stages need: target, tokenizer, drafter (with the target's embedding),
prompt ids through the chat template, EOS ids, and the backend choice ("auto")."""

from __future__ import annotations

import logging
from typing import Any

import torch

from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)


def check_drafter_path(path: str) -> None:
    """Refuse a drafter path that is not there, before any target is loaded (a large one takes minutes)."""
    from pathlib import Path

    from eaglekit.targets.loading import missing_path_error

    if not Path(path).exists():
        raise missing_path_error(
            path, "drafter", "pass drafter= the directory `eaglekit train` or `eaglekit import` wrote"
        )


def check_request(method: str, drafter: str, **options: Any) -> str:
    """What generate and serve refuse before any model is loaded (a large target takes minutes): an option the
    method has no use for, a drafter path that is not there, a method the saved drafter's type cannot draft with,
    options its config cannot draft with (`options`: `DecodeOptions` fields). -> the method, `auto` resolved: plain
    without a drafter; with one, tree where its type drafts with it, else the type's own (dflash, dspark)."""
    from eaglekit import registry
    from eaglekit.config.decode import DecodeOptions
    from eaglekit.decode import check_drafter_options, check_method_options
    from eaglekit.formats.saved import saved_drafter_config

    if drafter and method != "plain":
        check_drafter_path(drafter)
        config = saved_drafter_config(drafter)
        kind = registry.of_config(config)
        if method == "auto":
            method = "tree" if "tree" in kind.methods else kind.methods[0]
    elif method == "auto":
        method = "plain"
    opts = DecodeOptions(method=method, **options)
    check_method_options(opts)
    if method == "plain":
        return method
    if not drafter:
        raise EaglekitError(f"method={method} needs drafter=DIR (a trained or imported drafter), or use method=plain")
    registry.check_type_method(method, kind)
    check_drafter_options(config, opts)
    return method


def load_drafter(path: str, target: torch.nn.Module, device: torch.device, dtype: torch.dtype, target_name: str = ""):
    """An eaglekit drafter on `device`, checked against `target` (refused when made for a structurally different
    one); a drafter saved without its embedding gets the target's. `target_name` defaults to the loaded path."""
    from eaglekit.formats.saved import check_drafter_target, load_saved_drafter
    from eaglekit.targets.identity import target_weights_hash

    check_drafter_path(path)
    drafter = load_saved_drafter(path, device=device, dtype=dtype).eval()  # the class of its saved drafter_type
    drafter.requires_grad_(False)
    weights = target_weights_hash(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    check_drafter_target(
        drafter.config, target.config, path, target_name or getattr(target.config, "_name_or_path", ""), weights
    )
    if not bool(drafter.embed_tokens.weight.any()):
        drafter.load_target_embedding(target.get_input_embeddings().weight)
    if drafter.config.vocab_size != target.get_output_embeddings().weight.shape[0]:
        raise EaglekitError(
            f"drafter {path} was made for a vocabulary of {drafter.config.vocab_size} tokens, the target has "
            f"{target.get_output_embeddings().weight.shape[0]}: train or import a drafter for this target"
        )
    return drafter


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], chat: bool = True) -> list[int]:
    """Token ids of `messages` + the generation prompt (chat template), or of the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def eos_ids(tokenizer: Any, target: torch.nn.Module) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in (getattr(getattr(target, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def resolve_backend(name: str, target: torch.nn.Module) -> str:
    """'auto' -> 'static' for Llama-family dense targets, else 'eager'."""
    if name != "auto":
        return name
    from eaglekit.decode.static import StaticLlama

    try:
        StaticLlama(target, 8, None)
    except EaglekitError as error:
        reason = str(error).replace("; use backend=eager", "").replace(" (use backend=eager)", "")
        log.info("static fast path unavailable (%s); using the eager backend", reason)
        return "eager"
    return "static"
