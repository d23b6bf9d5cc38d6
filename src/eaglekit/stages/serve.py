"""Serve the target over a small OpenAI-compatible HTTP API (/v1/models, /v1/chat/completions, /metrics).

    eaglekit serve target=meta-llama/Llama-3.1-8B-Instruct port=8000
    eaglekit regen prompts.jsonl output=runs/regen backend=openai servers=http://127.0.0.1:8000

Listens on 127.0.0.1 unless `host=` says otherwise. With `api_key=` (or $EAGLEKIT_API_KEY) every
route but /health needs `Authorization: Bearer KEY`. Requests wait in a bounded queue (503 when
full); queued non-streaming requests with equal sampling settings are generated as one batch.
The engine is built by `build_engine`: the place where a speculative (drafter) engine plugs in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from eaglekit import registry
from eaglekit.config import check_options, option
from eaglekit.config.decode import CHAIN_METHODS, DRAFT_TOPK, VERIFY_THRESHOLD, DecodeOptions
from eaglekit.errors import EaglekitError
from eaglekit.generation.backends import HFBackend
from eaglekit.generation.server import ChatServer, GenerationEngine

log = logging.getLogger(__name__)

POSITIONAL = ("target",)


@dataclass(frozen=True)
class Config:
    target: str = option("", "target model directory, hub id or 'tiny'")
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 exposes the server to the network)")
    port: int = option(8000, "TCP port (0 = any free port)", min=0, max=65535)
    api_key: str = option("", "require 'Authorization: Bearer KEY' (default: $EAGLEKIT_API_KEY; empty = no key)")
    model_name: str = option("", "model name in /v1/models and responses (default: the target's directory name)")
    queue_size: int = option(64, "requests that may wait; more get HTTP 503", min=1)
    max_batch_size: int = option(8, "queued non-streaming requests with equal settings generated together", min=1)
    max_tokens: int = option(512, "max_tokens when a request gives none", min=1)
    max_tokens_limit: int = option(8192, "largest max_tokens a request may ask for", min=1)
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1)")
    dtype: str = option("auto", "dtype (auto = bf16 on GPU, fp32 on CPU)")
    chat_template: str = option("", "chat template (Jinja text or file) instead of the tokenizer's own")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")
    drafter: str = option(
        "", "eaglekit drafter directory: decode speculatively (batch 1), acceptance stats on /metrics"
    )
    method: str = option("auto", "with drafter: speculative decoding method, one the drafter's type drafts with "
                         "(auto: tree where it drafts with it, else its own: dflash, dspark)",
                         choices=("auto", *registry.method_names()))
    chain_length: int = option(
        DecodeOptions.chain_length, "with drafter, a chain method (chain, parallel, dflash, dspark): draft tokens per "
        "target forward", min=1)
    verify_threshold: float = option(0.0, "with drafter: " + VERIFY_THRESHOLD, min=0, max=1)
    draft_topk: int = option(0, "with drafter: " + DRAFT_TOPK, min=0)
    depth: int = option(DecodeOptions.depth, "with drafter, method=tree: draft levels", min=1)
    total_tokens: int = option(
        DecodeOptions.total_tokens, "with drafter, method=tree: draft nodes verified per target forward"
    , min=1)
    tree_top_k: int = option(
        DecodeOptions.tree_top_k, "with drafter, method=tree: children per node and nodes expanded per level"
    , min=1)


def build_engine(config: Config) -> GenerationEngine:
    """The generation engine behind the server (the in-process target, or speculative with a drafter)."""
    from eaglekit.decode.setup import check_request

    method = check_request(config.method if config.drafter else "plain", config.drafter,
                           chain_length=config.chain_length, verify_threshold=config.verify_threshold,
                           draft_topk=config.draft_topk)
    config = dataclasses.replace(config, method=method)  # auto resolved
    base = HFBackend.load(config.target, config.device, config.dtype, config.trust_remote_code, config.chat_template)
    if not config.drafter:
        return base
    from eaglekit.decode.serving import SpeculativeEngine
    from eaglekit.decode.setup import load_drafter, resolve_backend

    weights = next(base.model.parameters())
    drafter = load_drafter(config.drafter, base.model, weights.device, weights.dtype, config.target)
    chain = config.method in CHAIN_METHODS
    shape = (
        {"chain_length": config.chain_length}
        if chain
        else {"depth": config.depth, "total_tokens": config.total_tokens, "tree_top_k": config.tree_top_k}
    )
    chosen = {name: value for name, value in (("verify_threshold", config.verify_threshold),
                                              ("draft_topk", config.draft_topk)) if value}  # set, not defaults
    engine = SpeculativeEngine(base, drafter, config.method, resolve_backend("auto", base.model), **shape, **chosen)
    width = 1 + (config.chain_length if chain else config.total_tokens)  # draft slots per step
    engine.max_context = engine.decoder.max_length - width - 1  # the decoder's cache also holds one step's drafts
    return engine


def build_server(config: Config, engine: GenerationEngine | None = None) -> ChatServer:
    """A bound, not yet started server for `config` (tests call `.start()`, the CLI `.serve_forever()`)."""
    check_options(config)  # each option within its declared range (the CLI's load_config checked them already)
    if not config.target:
        raise EaglekitError("no target given: eaglekit serve PATH_OR_HUB_ID (or target=tiny)")
    if config.max_tokens < 1 or config.max_tokens > config.max_tokens_limit:
        raise EaglekitError("max_tokens must be between 1 and max_tokens_limit")
    is_path = Path(config.target).expanduser().exists()
    name = config.model_name or (Path(config.target.rstrip("/")).name if is_path else config.target)
    return ChatServer(
        engine if engine is not None else build_engine(config),
        name,
        config.host,
        config.port,
        api_key=config.api_key or os.environ.get("EAGLEKIT_API_KEY", ""),
        queue_size=config.queue_size,
        max_batch_size=config.max_batch_size,
        default_max_tokens=config.max_tokens,
        max_tokens_limit=config.max_tokens_limit,
    )


def run(config: Config) -> None:
    server = build_server(config)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model", config.host)
    print(f"eaglekit serve: {server.model_name} on {server.url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("eaglekit serve: stopped", flush=True)
