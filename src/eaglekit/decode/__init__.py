"""Speculative decoding with a drafter of any type: pure sampling/tree/verification functions, an eager reference
backend for any Hugging Face causal LM, and a static-KV-cache fast path for Llama-family targets; each drafter type's
drafting comes from its folder through `eaglekit.registry`. Entry point: `generate(target, drafter, prompt_ids,
max_new_tokens, method=...)`.
"""

from __future__ import annotations

import torch

from eaglekit import registry
from eaglekit.config.decode import CHAIN_METHODS
from eaglekit.decode.engine import METHODS, DecodeOptions, DecodeStats, GenerateResult, decode_loop
from eaglekit.errors import EaglekitError

BACKENDS = ("eager", "static")


def static_drafter_supported(drafter: torch.nn.Module) -> bool:
    """True when a static drafter step of one of its type's methods covers `drafter` (an EAGLE-3 drafter with a
    Llama-style midlayer, a DFlash drafter, ...). Any other drafter (another midlayer, or an object that only keeps
    the drafter contract) runs the eager reference drafter, also under backend=static."""
    return any(registry.speculative_method(name).static_supported(drafter) for name in registry.of(drafter).methods)


def drafter_aux_layers(drafter: torch.nn.Module) -> tuple[int, ...]:
    """The drafter's aux layer ids in the input-of-layer convention the capture hooks use."""
    from eaglekit.targets.capture import to_input_convention

    config = drafter.config
    return to_input_convention(tuple(config.aux_layer_ids), config.aux_layer_convention)


def check_method_options(opts: DecodeOptions) -> None:
    """Refuse a decode option that the method has no use for (checked from the options alone, before any model)."""
    method = opts.method
    speculative = None if method == "plain" else registry.speculative_method(method)
    if opts.verify_threshold > 0 and not (speculative and speculative.confidence):
        raise EaglekitError(f"verify_threshold={opts.verify_threshold} cuts a chain by the drafter's calibrated "
                            f"confidence, which method={method} has none of: use a drafter whose method has one (a "
                            "DSpark drafter with a confidence head, method=dspark), or leave verify_threshold at 0")
    if opts.draft_topk and not (speculative and speculative.markov):
        raise EaglekitError(f"draft_topk={opts.draft_topk} picks the candidates of a Markov head's correction, which "
                            f"method={method} has none of: use method=dspark with a DSpark drafter, or leave "
                            "draft_topk at 0")


def check_drafter_options(config, opts: DecodeOptions) -> None:
    """Refuse what a drafter of `config` cannot draft with `opts`, from its config alone (before its weights load):
    more drafts a step than its chain makes, what the method itself refuses."""
    if opts.method in CHAIN_METHODS:
        registry.of_config(config).check_drafts(config, opts.chain_length)
    speculative = registry.speculative_method(opts.method)
    if speculative.check is not None:
        speculative.check(config, opts)


class Decoder:
    """Holds a target, an optional drafter and their backends, so that repeated `generate` calls reuse
    the static caches and compiled steps (a compiled step is built once per shape, not per call)."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module | None = None, backend: str = "eager",
                 compile: bool = False, max_length: int = 2048):
        if backend not in BACKENDS:
            raise EaglekitError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
        self.target, self.drafter, self.backend = target, drafter, backend
        self.compile, self.max_length = compile, max_length
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self._targets: dict = {}
        self._drafters: dict = {}
        self._fused: dict = {}
        # static target + static drafter: each speculative step runs fused (fused.py); else the reference loop
        self.static_drafter = backend == "static" and drafter is not None and static_drafter_supported(drafter)

    def _target_backend(self, aux_layers):
        if self.backend == "eager":
            from eaglekit.decode.backends import HFTarget

            return HFTarget(self.target, aux_layers)
        from eaglekit.decode.static import StaticTarget

        if aux_layers not in self._targets:
            self._targets[aux_layers] = StaticTarget(self.target, self.max_length, aux_layers, compile=self.compile)
        backend = self._targets[aux_layers]
        backend.reset()
        return backend

    def _static(self, method) -> bool:
        """True when target and drafter both run static for `method`: its steps then run fused (fused.py)."""
        return self.static_drafter and method.static_supported(self.drafter)

    def _drafter_backend(self, opts: DecodeOptions, method):
        if not self._static(method):
            return method.eager_backend(self.drafter)
        chain = opts.method in CHAIN_METHODS
        slots = opts.chain_length if chain else opts.depth * opts.tree_top_k  # draft slots
        key = (method.static_backend, slots)
        if key not in self._drafters:
            self._drafters[key] = method.static_backend(self.drafter, self.max_length, slots, self.compile)
        backend = self._drafters[key]
        backend.reset()
        return backend

    def _fused_step(self, target_backend, drafter_backend, opts: DecodeOptions, vocab_size: int, method):
        """The one-function speculative step (`fused.FusedStep`) when target and drafter both run static, else
        None (the step-by-step loop of `engine.decode_loop`). One step object per target, options shape, vocab."""
        if not self._static(method):
            return None
        from eaglekit.decode.fused import FusedStep, fused_shape

        key = (id(target_backend), id(drafter_backend), fused_shape(opts), vocab_size)
        if key not in self._fused:
            self._fused[key] = FusedStep(target_backend, drafter_backend, opts, vocab_size, method)
        return self._fused[key]

    def generate(self, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int, method: str = "tree",
                 on_tokens=None, **options) -> GenerateResult:
        """Decode `max_new_tokens` after `prompt_ids` (batch 1); `options` are `DecodeOptions` fields.
        `on_tokens(list[int])` is called with each step's new tokens (streaming; EOS left out)."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        if not prompt_ids:
            raise EaglekitError("the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise EaglekitError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if isinstance(options.get("eos_token_ids"), int):
            options["eos_token_ids"] = (options["eos_token_ids"],)
        opts = DecodeOptions(method=method, **options)
        if method != "plain" and self.drafter is None:
            raise EaglekitError(f"method={method} needs a drafter; pass one, or use method=plain")
        check_method_options(opts)
        speculative = None
        if method != "plain":
            registry.check_method(method, self.drafter)
            check_drafter_options(self.drafter.config, opts)
            speculative = registry.speculative_method(method)
        width = 0 if method == "plain" else 1 + (opts.chain_length if method in CHAIN_METHODS else opts.total_tokens)
        if self.backend == "static" and len(prompt_ids) + max_new_tokens + width + 1 > self.max_length:
            raise EaglekitError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + "
                                f"draft nodes ({width}) exceed the static cache ({self.max_length} "
                                "slots); raise max_length")
        aux_layers = None if method == "plain" else drafter_aux_layers(self.drafter)
        target_backend = self._target_backend(aux_layers)
        drafter_backend = None if speculative is None else self._drafter_backend(opts, speculative)
        fused = (None if speculative is None
                 else self._fused_step(target_backend, drafter_backend, opts, self.vocab_size, speculative))
        with torch.inference_mode():
            return decode_loop(target_backend, drafter_backend, self.drafter, prompt_ids, max_new_tokens, opts,
                               self.vocab_size, on_tokens, fused, speculative.grow if speculative else None)


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
    """One-off decode (see `Decoder.generate`). `options`: temperature, top_k, top_p, depth, tree_top_k,
    total_tokens, chain_length, eos_token_ids, seed.

    backend="eager" works for any HF causal LM; backend="static" is the fast path for Llama-family
    dense targets (preallocated KV caches; `compile=True` adds torch.compile + CUDA graphs).
    """
    n = prompt_ids.numel() if isinstance(prompt_ids, torch.Tensor) else len(prompt_ids)
    defaults = DecodeOptions()
    width = 2 + max(options.get("chain_length", defaults.chain_length),
                    options.get("total_tokens", defaults.total_tokens))
    decoder = Decoder(target, drafter, backend, compile, max_length or n + max_new_tokens + width)
    return decoder.generate(prompt_ids, max_new_tokens, method, **options)


__all__ = ["Decoder", "generate", "DecodeOptions", "DecodeStats", "GenerateResult", "METHODS", "BACKENDS",
           "drafter_aux_layers", "static_drafter_supported"]
