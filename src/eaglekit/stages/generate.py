"""Generate text with speculative decoding (any drafter type and its methods) and report acceptance.

    eaglekit generate --target meta-llama/Llama-3.1-8B-Instruct --drafter runs/drafter --prompt "Hello"
    eaglekit generate target=tiny method=plain prompt="def fib(n):"

Prints the completion, then tau (mean tokens per target forward) and acceptance per draft position.
`output=FILE.json` also writes the tokens, text, statistics and the resolved config.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from eaglekit import registry
from eaglekit.config import option, to_dict
from eaglekit.config.decode import DRAFT_TOPK, METHODS, VERIFY_THRESHOLD, DecodeOptions
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

POSITIONAL = ("prompt",)


@dataclass(frozen=True)
class Config:
    target: str = option("", "target model directory, hub id or 'tiny'")
    drafter: str = option("", "eaglekit drafter directory (needed unless method=plain)")
    prompt: str = option("", "the user message")
    chat: bool = option(True, "wrap the prompt in the tokenizer's chat template (when it has one)")
    max_new_tokens: int = option(128, "tokens to generate at most", min=1)
    method: str = option("auto", "decoding method: plain, or one the drafter's type drafts with (" +
                         "; ".join(f"{name}: {method.summary}" for name, (method, _) in registry.all_methods().items())
                         + "); auto: tree where the drafter's type drafts with it, else its own (dflash, dspark), "
                         "plain without a drafter", choices=("auto", *METHODS))
    temperature: float = option(0.0, "0 = greedy; > 0 samples with the speculative-sampling rule "
                                     "(output follows the target)", min=0)
    top_p: float = option(1.0, "nucleus sampling threshold (1 = off)", above=0, max=1)
    top_k: int = option(0, "sample from the k most likely tokens (0 = off)", min=0)
    depth: int = option(DecodeOptions.depth, "tree: draft levels", min=1)
    tree_top_k: int = option(DecodeOptions.tree_top_k, "tree: children per node and nodes expanded per level", min=1)
    total_tokens: int = option(DecodeOptions.total_tokens, "tree: draft nodes verified per target forward", min=1)
    chain_length: int = option(DecodeOptions.chain_length, "chain, parallel, dflash, dspark: draft tokens per target "
                               "forward", min=1)
    verify_threshold: float = option(0.0, VERIFY_THRESHOLD, min=0, max=1)
    draft_topk: int = option(0, DRAFT_TOPK, min=0)
    backend: str = option("auto", "auto = static fast path for Llama-family dense targets, else eager",
                          choices=("auto", "eager", "static"))
    compile: bool = option(False, "torch.compile + CUDA graphs for the static backend's fixed-shape steps (GPU only; "
                                  "pays off on long outputs)")
    seed: int = option(0, "sampling seed", min=0)
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1)")
    dtype: str = option("auto", "dtype (auto = bf16 on GPU, fp32 on CPU)")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")
    output: str = option("", "write the result as JSON to this file (optional)")


def run(config: Config) -> dict[str, Any]:
    from eaglekit.decode import generate
    from eaglekit.decode.setup import check_request, eos_ids, load_drafter, prompt_ids, resolve_backend
    from eaglekit.manifest import atomic_write_json, check_output_file, environment
    from eaglekit.runtime import resolve_device, resolve_dtype
    from eaglekit.targets.loading import load_target, load_tokenizer

    if not config.prompt:
        raise EaglekitError('no prompt given: eaglekit generate "your prompt" (or prompt=...)')
    method = check_request(config.method, config.drafter, chain_length=config.chain_length,
                           verify_threshold=config.verify_threshold, draft_topk=config.draft_topk)
    config = dataclasses.replace(config, method=method)  # auto resolved, as the output records it
    if config.output:
        check_output_file(config.output, "generate.json")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target = load_target(config.target, device, dtype, config.trust_remote_code)
    tokenizer = load_tokenizer(config.target, config.trust_remote_code)
    drafter = load_drafter(config.drafter, target, device, dtype, config.target) if config.method != "plain" else None
    ids = prompt_ids(tokenizer, [{"role": "user", "content": config.prompt}], config.chat)
    backend = resolve_backend(config.backend, target)
    result = generate(target, drafter, ids, config.max_new_tokens, method=config.method, backend=backend,
                      compile=config.compile and device.type == "cuda", temperature=config.temperature,
                      top_p=config.top_p, top_k=config.top_k,
                      depth=config.depth, tree_top_k=config.tree_top_k, total_tokens=config.total_tokens,
                      chain_length=config.chain_length, verify_threshold=config.verify_threshold,
                      draft_topk=config.draft_topk, eos_token_ids=eos_ids(tokenizer, target), seed=config.seed)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    stats = result.stats.to_dict()
    seconds = stats["prefill_seconds"] + stats["decode_seconds"]
    report = {"text": text, "tokens": result.tokens, "finish_reason": result.finish_reason, "backend": backend,
              "tokens_per_second": len(result.tokens) / seconds if seconds > 0 else None, **stats}
    print(text)
    rates = ", ".join(f"{r:.2f}" for r in stats["acceptance_per_position"])
    print(f"\n[{config.method}/{backend}] {len(result.tokens)} tokens, tau {stats['tau']:.2f}, "
          f"acceptance per position [{rates}], {report['tokens_per_second'] or 0:.1f} tokens/s"
          + (f", {stats['verified_per_step']:.2f} drafts verified per step" if "verified_per_step" in stats else ""))
    if config.output:
        atomic_write_json(config.output, {**report, "config": to_dict(config), "environment": environment()})
    return report
