"""Speculative decoding with an EAGLE-3 drafter: pure sampling/tree/verification functions, an eager
reference backend for any Hugging Face causal LM, and a static-KV-cache fast path for Llama-family
targets. Entry point: `generate(target, drafter, prompt_ids, max_new_tokens, method=...)`.
"""

from __future__ import annotations

import torch

from eaglekit.decode.engine import METHODS, DecodeOptions, DecodeStats, GenerateResult, decode_loop
from eaglekit.errors import EaglekitError

BACKENDS = ("eager", "static")


def drafter_aux_layers(drafter: torch.nn.Module) -> tuple[int, ...]:
    """The drafter's aux layer ids in the input-of-layer convention the capture hooks use."""
    from eaglekit.target.capture import to_input_convention

    config = drafter.config
    return to_input_convention(tuple(config.aux_layer_ids), config.aux_layer_convention)


def generate(
    target: torch.nn.Module,
    drafter: torch.nn.Module | None,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    method: str = "tree",
    backend: str = "eager",
    compile: bool = False,
    max_length: int | None = None,
    **options,
) -> GenerateResult:
    """Decode `max_new_tokens` after `prompt_ids` (batch 1). `options` are `DecodeOptions` fields
    (temperature, top_k, top_p, depth, tree_top_k, total_tokens, chain_length, eos_token_ids, seed).

    backend="eager" works for any HF causal LM; backend="static" is the fast path for Llama-family
    dense targets (preallocated KV caches; `compile=True` adds torch.compile + CUDA graphs).
    """
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    if not prompt_ids:
        raise EaglekitError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise EaglekitError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if "eos_token_ids" in options and isinstance(options["eos_token_ids"], int):
        options["eos_token_ids"] = (options["eos_token_ids"],)
    opts = DecodeOptions(method=method, **options)
    if method != "plain" and drafter is None:
        raise EaglekitError(f"method={method} needs a drafter; pass one, or use method=plain")
    aux_layers = None if method == "plain" else drafter_aux_layers(drafter)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if backend == "eager":
        from eaglekit.decode.backends import EagerDrafter, HFTarget

        target_backend = HFTarget(target, aux_layers)
        drafter_backend = None if drafter is None or method == "plain" else EagerDrafter(drafter)
    elif backend == "static":
        from eaglekit.decode.static import StaticDrafter, StaticTarget

        width = 1 + (opts.chain_length if method == "chain" else opts.total_tokens)
        capacity = max_length or (len(prompt_ids) + max_new_tokens + width + 1)
        target_backend = StaticTarget(target, capacity, aux_layers, compile=compile)
        drafter_backend = None
        if drafter is not None and method != "plain" and not hasattr(drafter, "midlayer"):
            from eaglekit.decode.backends import EagerDrafter  # a drafter stand-in (tests): reference backend

            drafter_backend = EagerDrafter(drafter)
        elif drafter is not None and method != "plain":
            slots = opts.chain_length if method == "chain" else opts.depth * opts.tree_top_k
            drafter_backend = StaticDrafter(drafter, capacity, slots, compile=compile)
    else:
        raise EaglekitError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    with torch.inference_mode():
        return decode_loop(target_backend, drafter_backend, drafter, prompt_ids, max_new_tokens, opts, vocab_size)


__all__ = ["generate", "DecodeOptions", "DecodeStats", "GenerateResult", "METHODS", "BACKENDS", "drafter_aux_layers"]
