"""The speculative generation engine behind `eaglekit serve drafter=DIR`.

Implements the engine interface of `eaglekit.generation.server` (encode_chat, decode, text_stream, generate,
generate_many, metrics): tokenisation is the HF backend's, generation is `eaglekit.decode.Decoder`
(batch 1; a batch of queued requests is decoded one after another). `metrics()` reports cumulative
acceptance: tau and acceptance per draft position, shown under "engine" on `/metrics`; each
response's `EngineOutput.stats` carries that request's tau and acceptance.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from eaglekit.decode import Decoder
from eaglekit.decode.engine import DecodeOptions, DecodeStats
from eaglekit.generation.backends import EngineOutput, HFBackend


class SpeculativeEngine:
    def __init__(self, base: HFBackend, drafter: torch.nn.Module, method: str = "tree", backend: str = "eager",
                 compile: bool = False, **options: Any):
        if method != "plain":  # a target whose layers speculative decoding cannot run: refused before serving
            from eaglekit.decode.windows import check_speculative

            check_speculative(base.model.config, getattr(base.model.config, "_name_or_path", "") or "the target")
        self.base = base
        self.max_context = base.max_context
        self.method, self.options = method, options
        # the static cache spans the whole buffer every step: cap it rather than allocate e.g. 128k slots
        self.decoder = Decoder(base.model, drafter, backend, compile, max_length=min(base.max_context or 4096, 8192))
        self.total = DecodeStats(max_drafts=DecodeOptions(method=method, **options).draft_depth)
        self.requests = 0
        self._lock = threading.Lock()

    @classmethod
    def load(cls, target: str, drafter: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False,
             method: str = "tree", backend: str = "auto", compile: bool = False) -> "SpeculativeEngine":
        from eaglekit.decode.setup import load_drafter, resolve_backend

        base = HFBackend.load(target, device, dtype, trust_remote_code)
        model_param = next(base.model.parameters())
        loaded = load_drafter(drafter, base.model, model_param.device, model_param.dtype)
        return cls(base, loaded, method, resolve_backend(backend, base.model), compile)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.base.encode_chat(messages)

    def decode(self, ids: list[int]) -> str:
        return self.base.decode(ids)

    def text_stream(self) -> Any:
        return self.base.text_stream()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, on_tokens: Callable[[list[int]], None] | None = None) -> EngineOutput:
        with self._lock:  # one decoder, one sequence at a time
            result = self.decoder.generate(prompt_ids, max_new_tokens, self.method, on_tokens=on_tokens,
                                           temperature=temperature, top_p=top_p, seed=seed or 0,
                                           eos_token_ids=tuple(self.base.eos_ids), **self.options)
            self.total.accepted.extend(result.stats.accepted)
            self.total.verified.extend(result.stats.verified)
            self.requests += 1
        ids = [t for t in result.tokens if t not in self.base.eos_ids]
        stats = {"tau": result.stats.tau, "acceptance_per_position": result.stats.acceptance_per_position()}
        return EngineOutput(ids, "stop" if result.finish_reason == "eos" else "length", stats)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None) -> list[EngineOutput]:
        return [self.generate(p, max_new_tokens, temperature, top_p, seed) for p in prompts]

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return {"engine": "eaglekit-speculative", "method": self.method, "requests": self.requests,
                    "verify_steps": len(self.total.accepted), "tau": self.total.tau,
                    "acceptance_per_position": self.total.acceptance_per_position(),
                    **({"verified_per_step": sum(self.total.verified) / len(self.total.verified)}
                       if self.total.verified else {})}
