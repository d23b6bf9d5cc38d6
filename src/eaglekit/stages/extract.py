"""Run the target over tokenised conversations and store its aux and final hidden states for training.

    eaglekit extract data.jsonl output=runs/hidden target=meta-llama/Llama-3.1-8B-Instruct
    torchrun --nproc-per-node 8 -m eaglekit extract data.jsonl output=runs/hidden target=...   # data-parallel
    eaglekit extract data.jsonl output=runs/hidden target=big-model device_map=auto             # one model, many GPUs
    eaglekit extract data.jsonl output=runs/hidden target=big-model backend=vllm tensor_parallel_size=8  # vLLM captures

Per record the store holds token ids, loss mask, the states entering decoder layers `aux_layer_ids`
(input_of_layer convention, default 2, L//2, L-3) and the final-norm output (what the lm_head reads).
Batches are length-sorted and right-padded; padding is stripped before storing. Shards are bounded,
written atomically by background threads (as many as the cores allow, see `writer_parallelism`), and
logged; a re-run resumes after the last complete shard.
See docs/extract.md for the layout (`eaglekit.targets.store`) and `HiddenStateDataset` for reading it; the work
(batching, the hooked forwards, resume) is `eaglekit.targets.extract`. `backend=vllm` has vLLM capture the states
(`eaglekit.vllm.extract`; `regenerate=true` answers the prompts in the same engine run) into the same store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglekit.config import option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.layers import CONVENTIONS, INPUT_OF_LAYER

log = logging.getLogger(__name__)

POSITIONAL = ("data",)


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((),
                                   "conversation files or directories (OpenAI messages, ShareGPT, prompt/completion)")
    output: str = option("", "output directory (shards, shard logs, manifest.json, config.yaml)")
    target: str = option("", "target model directory, hub id or 'tiny'")
    max_length: int = option(2048, "tokens per record; longer records are truncated (and counted); 0 = no limit",
                             min=0)
    aux_layer_ids: tuple[int, ...] = option((), "layer ids to capture: 3 for EAGLE-3 (empty = 2, L//2, L-3; "
                                            "distinct ones on targets under 7 layers), a DFlash drafter's "
                                            "target_layer_ids + 1 (input-of-layer; -1 with output_of_layer = "
                                            "the embedding output)", min=-1)
    aux_layer_convention: str = option(INPUT_OF_LAYER, "meaning of aux_layer_ids", choices=CONVENTIONS)
    # the choices spell out eaglekit.targets.store.STORAGE_DTYPES, which needs torch (tests/test_cli.py checks)
    dtype: str = option("bf16", "storage dtype; float8_e4m3fn halves the bytes (per-row scales)",
                        choices=("bf16", "fp16", "fp32", "float8_e4m3fn"))
    model_dtype: str = option("auto", "dtype the target runs in (auto = bf16 on GPU, fp32 on CPU)")
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1); under torchrun each rank uses cuda:LOCAL_RANK")
    device_map: str = option("", "'auto' spreads one large target over all visible GPUs (not with torchrun)")
    batch_tokens: int = option(16384, "padded tokens per forward (batch size x longest record)", min=1)
    max_batch_size: int = option(64, "most records per forward", min=1)
    shard_mb: float = option(256.0, "approximate size of one shard file and host buffer in MiB (at least one batch)",
                             above=0)
    buffers: int = option(0, "pinned host shard buffers in the writer ring (0 = auto: writer_threads + 2); "
                             "host memory = buffers x shard_mb", min=0)
    writer_threads: int = option(0, "threads hashing and writing shards in parallel (0 = auto: half the CPU cores "
                                    "per process, 2..8)", min=0)
    fsync: bool = option(True, "fsync each shard before logging it (off: faster on slow disks; a power loss may "
                               "cost the last shards)")
    chat_template: str = option("", "chat template (Jinja text or file) instead of the tokenizer's own")
    decoder_path: str = option("", "dotted path of the decoder layer list, when the search picks the wrong one")
    limit: int = option(0, "extract only the first N records (0 = all)", min=0)
    skip_errors: bool = option(False, "skip malformed input records instead of stopping")
    overwrite: bool = option(False, "delete an existing store in output (else resume it); also allows an output "
                                    "directory that another stage wrote")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")
    backend: str = option("hf", "hf: the target in this process (hooks); vllm: captured by vLLM's "
                                "extract_hidden_states in vLLM's own Python (the same store)", choices=("hf", "vllm"))
    regenerate: bool = option(False, "backend=vllm: answer each record's prompt (its messages before the last "
                                     "assistant turn) with the target and store prompt + answer; writes "
                                     "regenerated.jsonl beside the store")
    max_new_tokens: int = option(1024, "regenerate: most tokens per answer", min=1)
    temperature: float = option(0.0, "regenerate: sampling temperature (0 = greedy)", min=0)
    seed: int = option(0, "regenerate: sampling seed (each record's own is derived from it and the record id)", min=0)
    tensor_parallel_size: int = option(1, "backend=vllm: GPUs (CPU: core groups) the engine shards the target over",
                                       min=1)
    vllm_python: str = option("", "backend=vllm: a Python with vLLM (default: this one if it imports vllm, else "
                                  ".venv-vllm)")
    vllm_version_check: bool = option(True, "backend=vllm: refuse a vLLM other than the tested version")
    spool_dir: str = option("", "backend=vllm: where vLLM's per-request files wait to be stored (default: inside "
                                "output; a RAM disk such as /dev/shm saves writing every state twice)")
    vllm_engine_args: str = option("", "backend=vllm: JSON object of extra vllm.LLM arguments, e.g. "
                                       "'{\"gpu_memory_utilization\": 0.9, \"enable_expert_parallel\": true}'")


@dataclass
class ExtractResult:
    output: Path
    stats: dict[str, Any] = field(default_factory=dict)


def _check(config: Config) -> None:
    if not config.output:
        raise EaglekitError("no output directory: pass output=DIR")
    if not config.data:
        raise EaglekitError("no data: pass conversation files, e.g. eaglekit extract data.jsonl output=DIR target=...")


def run(config: Config) -> ExtractResult:
    if config.backend == "vllm":
        from eaglekit.vllm.extract import capture_store

        _check(config)
        return ExtractResult(*capture_store(config))
    if config.regenerate or config.tensor_parallel_size != 1:
        raise EaglekitError("regenerate and tensor_parallel_size run in the engine: pass backend=vllm (or run "
                            "eaglekit regen, then extract its conversations.jsonl)")
    from eaglekit.manifest import claim_output
    from eaglekit.runtime import resolve_dtype
    from eaglekit.targets import extract as lib
    from eaglekit.targets.capture import HiddenStateCapture, find_decoder, text_config
    from eaglekit.targets.loading import load_target, load_target_config, load_tokenizer
    from eaglekit.targets.shard_writer import writer_parallelism
    from eaglekit.targets.store import split_for_rank

    _check(config)
    rank, world = lib.distributed()
    parallelism = writer_parallelism(config.writer_threads, config.buffers)  # (threads, buffers); fails fast
    out = Path(config.output)
    if rank == 0:
        claim_output(out, "extract", config.overwrite)
    target_config = load_target_config(config.target, config.trust_remote_code)  # fails fast: bad path, remote code
    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    records, stats = lib.read_records(config.data, tokenizer, config.max_length, config.chat_template, config.limit,
                                      config.skip_errors)
    num_layers = int(getattr(text_config(target_config), "num_hidden_layers", 0) or 0)
    aux_ids = lib.resolve_aux_ids(config.aux_layer_ids, config.aux_layer_convention, num_layers, config.target)
    layout, identity = lib.layout_and_identity(target_config, tokenizer, aux_ids, config.dtype, config.max_length,
                                               config.chat_template)
    done = lib.prepare_output(out, identity, config.overwrite, rank, world)  # before loading a large model
    if rank == 0:
        save_resolved(config, out)
    device = lib.rank_device(config.device, config.device_map, world)
    model = load_target(config.target, device=device, dtype=resolve_dtype(config.model_dtype, device),
                        trust_remote_code=config.trust_remote_code, device_map=config.device_map or None)
    stack = find_decoder(model, config.decoder_path or None)
    if stack.num_layers != num_layers:
        raise EaglekitError(f"the decoder found at {stack.path} has {stack.num_layers} layers but the config says "
                            f"{num_layers}; pass decoder_path= naming the text decoder's layer list")
    todo = [r for r in records if r.id not in done]
    if todo and rank == 0:  # new records: the store is not finished until this run writes a new manifest
        (out / "manifest.json").unlink(missing_ok=True)
    batches = split_for_rank(lib.make_batches(todo, config.batch_tokens, config.max_batch_size), rank, world)
    log.info("rank %d/%d: %d records stored already, %d batches to extract", rank, world, len(done), len(batches))
    writer = lib.open_writer(out, layout, rank, parallelism, shard_mb=config.shard_mb, batch_tokens=config.batch_tokens,
                             pin=lib.input_device(model).type == "cuda", fsync=config.fsync, stats=stats,
                             metadata={"target": config.target, "dtype": config.dtype})
    begin = time.perf_counter()
    try:
        with HiddenStateCapture(model, aux_ids, decoder_path=stack.path) as capture:
            verification = lib.verify_first(model, capture, batches)
            tokens = lib.extract_batches(model, capture, batches, writer, layout, tokenizer.pad_token_id or 0,
                                         rank == 0)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - begin
    stats.update(tokens_extracted=tokens, seconds=round(seconds, 2),
                 tokens_per_second=round(tokens / max(seconds, 1e-9), 1),
                 writer_wait_seconds=round(writer.wait_seconds, 2))
    lib.barrier(world)
    if rank == 0:
        lib.write_store_manifest(out, model, stack.path, layout, identity,
                                 {"target": config.target, "world_size": world, "data": list(config.data),
                                  "stats": stats, "verification": verification})
    return ExtractResult(out, stats)




