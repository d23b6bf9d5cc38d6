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
See docs/extract.md for the layout (`eaglekit.target.store`) and `HiddenStateDataset` for reading it; the work
(batching, the hooked forwards, resume) is `eaglekit.target.extract`. `backend=vllm` has vLLM capture the states
(`eaglekit.vllm.capture`; `regenerate=true` answers the prompts in the same engine run) into the same store.
"""

from __future__ import annotations

import contextlib
import json
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
    max_length: int = option(2048, "tokens per record; longer records are truncated (and counted)")
    aux_layer_ids: tuple[int, ...] = option((), "layer ids to capture: 3 for EAGLE-3 (empty = 2, L//2, L-3; "
                                            "distinct ones on targets under 7 layers), a DFlash drafter's "
                                            "target_layer_ids + 1 (input-of-layer)")
    aux_layer_convention: str = option(INPUT_OF_LAYER, "meaning of aux_layer_ids", choices=CONVENTIONS)
    # the choices spell out eaglekit.target.store.STORAGE_DTYPES, which needs torch (tests/test_cli.py checks)
    dtype: str = option("bf16", "storage dtype; float8_e4m3fn halves the bytes (per-row scales)",
                        choices=("bf16", "fp16", "fp32", "float8_e4m3fn"))
    model_dtype: str = option("auto", "dtype the target runs in (auto = bf16 on GPU, fp32 on CPU)")
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1); under torchrun each rank uses cuda:LOCAL_RANK")
    device_map: str = option("", "'auto' spreads one large target over all visible GPUs (not with torchrun)")
    batch_tokens: int = option(16384, "padded tokens per forward (batch size x longest record)")
    max_batch_size: int = option(64, "most records per forward")
    shard_mb: float = option(256.0, "approximate size of one shard file and host buffer in MiB (at least one batch)")
    buffers: int = option(0, "pinned host shard buffers in the writer ring (0 = auto: writer_threads + 2); "
                             "host memory = buffers x shard_mb")
    writer_threads: int = option(0, "threads hashing and writing shards in parallel (0 = auto: half the CPU cores "
                                    "per process, 2..8)")
    fsync: bool = option(True, "fsync each shard before logging it (off: faster on slow disks; a power loss may "
                               "cost the last shards)")
    chat_template: str = option("", "chat template (Jinja text or file) instead of the tokenizer's own")
    decoder_path: str = option("", "dotted path of the decoder layer list, when the search picks the wrong one")
    limit: int = option(0, "extract only the first N records (0 = all)")
    skip_errors: bool = option(False, "skip malformed input records instead of stopping")
    overwrite: bool = option(False, "delete an existing store in output (else resume it); also allows an output "
                                    "directory that another stage wrote")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")
    backend: str = option("hf", "hf: the target in this process (hooks); vllm: captured by vLLM's "
                                "extract_hidden_states in vLLM's own Python (the same store)", choices=("hf", "vllm"))
    regenerate: bool = option(False, "backend=vllm: answer each record's prompt (its messages before the last "
                                     "assistant turn) with the target and store prompt + answer; writes "
                                     "regenerated.jsonl beside the store")
    max_new_tokens: int = option(1024, "regenerate: most tokens per answer")
    temperature: float = option(0.0, "regenerate: sampling temperature (0 = greedy)")
    seed: int = option(0, "regenerate: sampling seed (each record's own is derived from it and the record id)")
    tensor_parallel_size: int = option(1, "backend=vllm: GPUs (CPU: core groups) the engine shards the target over")
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
        _check(config)
        return _run_vllm(config)
    if config.regenerate or config.tensor_parallel_size != 1:
        raise EaglekitError("regenerate and tensor_parallel_size run in the engine: pass backend=vllm (or run "
                            "eaglekit regen, then extract its conversations.jsonl)")
    from eaglekit.manifest import claim_output
    from eaglekit.runtime import resolve_dtype
    from eaglekit.target import extract as lib
    from eaglekit.target.capture import HiddenStateCapture, find_decoder, text_config
    from eaglekit.target.loading import load_target, load_target_config, load_tokenizer
    from eaglekit.target.shard_writer import writer_parallelism
    from eaglekit.target.store import split_for_rank

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


# ---- backend=vllm ------------------------------------------------------------------------------------

def _target_config(config: Config) -> Any:
    """The target's HF config; for a class transformers lacks (vLLM may still serve it), config.json as a config."""
    from eaglekit.target.loading import load_target_config, local_model_dir

    try:
        return load_target_config(config.target, config.trust_remote_code)
    except EaglekitError:
        path = Path(local_model_dir(config.target)) / "config.json"
        if not path.is_file():
            raise
        from transformers import PretrainedConfig

        raw = json.loads(path.read_text())
        text = raw.get("text_config")
        log.warning("transformers does not know %s's config; reading config.json as it is", config.target)
        return PretrainedConfig(**{**raw, **({"text_config": PretrainedConfig(**text)} if text else {})})


def _engine_options(config: Config) -> Any:
    from eaglekit.vllm.capture import EngineOptions

    try:
        extra = json.loads(config.vllm_engine_args) if config.vllm_engine_args else {}
    except json.JSONDecodeError as error:
        raise EaglekitError(f"vllm_engine_args is not JSON ({error}); pass an object such as "
                            "'{\"gpu_memory_utilization\": 0.9}'") from None
    if not isinstance(extra, dict):
        raise EaglekitError("vllm_engine_args must be a JSON object of vllm.LLM arguments")
    if config.tensor_parallel_size < 1 or config.max_batch_size < 1 or config.max_new_tokens < 1:
        raise EaglekitError("tensor_parallel_size, max_batch_size and max_new_tokens must be >= 1")
    if config.temperature < 0:
        raise EaglekitError(f"temperature={config.temperature}: pass 0 (greedy) or more")
    if config.device_map or config.decoder_path:
        raise EaglekitError("device_map and decoder_path are backend=hf options: vLLM places and finds the layers "
                            "itself (tensor_parallel_size= shards the target)")
    return EngineOptions(config.vllm_python, config.vllm_version_check, config.tensor_parallel_size,
                         config.model_dtype, extra, max_in_flight=config.max_batch_size,
                         max_spool=2 * config.max_batch_size)


def _max_model_len(config: Config, target_config: Any, records: list[Any], prompts: list[int]) -> int:
    """Tokens the engine must hold per request: the longest record (+1 sampled token), or the longest prompt with
    its answer and the template's tail; never over the target's own context."""
    from eaglekit.vllm.regenerate import TEMPLATE_TAIL
    from eaglekit.target.capture import text_config

    context = int(getattr(text_config(target_config), "max_position_embeddings", 0) or 1 << 30)
    if config.regenerate:
        return min(context, max(prompts, default=1) + config.max_new_tokens + TEMPLATE_TAIL)
    longest = max((len(r.input_ids) for r in records), default=1)
    if longest + 1 > context:
        raise EaglekitError(f"a record has {longest} tokens, more than the target's context of {context} allows; "
                            f"lower max_length to {context - 1}")
    return longest + 1


REGENERATED_FILE = "regenerated.jsonl"


def _regeneration_data(config: Config, tokenizer: Any, done: set[str]) -> tuple[list[Any], Any, dict[str, int]]:
    """The conversations still to answer and how to answer them."""
    from eaglekit.data import read_conversations
    from eaglekit.data.tokenize import resolve_chat_template
    from eaglekit.vllm.regenerate import Regeneration

    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    conversations = conversations[: config.limit] if config.limit else conversations
    usable = [c for c in conversations if any(m.role == "user" for m in c.messages)]
    if not usable:
        raise EaglekitError(f"no conversation in {', '.join(config.data)} has a user turn to answer")
    eos = _eos_ids(config.target, tokenizer)
    regeneration = Regeneration(tokenizer, resolve_chat_template(tokenizer, config.chat_template or None),
                                config.max_length, config.max_new_tokens, config.temperature, config.seed, eos, 0)
    stats = {"records_read": len(conversations), "no_user_turn": len(conversations) - len(usable)}
    return [c for c in usable if c.id not in done], regeneration, stats


def _eos_ids(target: str, tokenizer: Any) -> tuple[int, ...]:
    """What ends an answer, as `regen backend=hf` reads it: generation_config's eos ids, then the tokenizer's."""
    from transformers import GenerationConfig

    from eaglekit.target.loading import local_model_dir

    ids: list[int] = []
    try:
        configured = GenerationConfig.from_pretrained(local_model_dir(target)).eos_token_id
    except OSError:
        configured = None
    for value in (configured, tokenizer.eos_token_id):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _kept_conversations(path: Path, done: set[str]) -> Any:
    """regenerated.jsonl cut to the records in logged shards (the others are answered again), opened to append."""
    from eaglekit.manifest import atomic_write_text

    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line)["id"] in done:
                kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))
    return open(path, "a")


def _run_vllm(config: Config) -> ExtractResult:
    import dataclasses

    from eaglekit.vllm import capture as vc
    from eaglekit.vllm import engine as ve
    from eaglekit.vllm import regenerate as vr
    from eaglekit.manifest import claim_output
    from eaglekit.target import extract as lib
    from eaglekit.target.capture import text_config
    from eaglekit.target.loading import load_tokenizer, local_model_dir
    from eaglekit.target.shard_writer import writer_parallelism

    options = _engine_options(config)
    parallelism = writer_parallelism(config.writer_threads, config.buffers)
    out = claim_output(Path(config.output), "extract", config.overwrite)
    target_dir = local_model_dir(config.target)
    target_config = _target_config(config)
    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    num_layers = int(getattr(text_config(target_config), "num_hidden_layers", 0) or 0)
    aux_ids = lib.resolve_aux_ids(config.aux_layer_ids, config.aux_layer_convention, num_layers, config.target)
    layers = vc.engine_layers(aux_ids, num_layers, ve.target_facts(target_dir)["mla"])  # before vLLM is touched
    engine = ve.find_engine(options.python, options.version_check)  # vLLM missing or another version
    layout, identity = lib.layout_and_identity(target_config, tokenizer, aux_ids, config.dtype, config.max_length,
                                               config.chat_template)
    if config.regenerate:
        identity["regenerate"] = {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                                  "seed": config.seed}
        if config.overwrite:
            (out / REGENERATED_FILE).unlink(missing_ok=True)
    done = lib.prepare_output(out, identity, config.overwrite, 0, 1)
    save_resolved(config, out)
    if config.regenerate:
        todo, regeneration, stats = _regeneration_data(config, tokenizer, done)
        prompts = [len(vr.prompt_ids(regeneration, vr.prompt_of(c))) for c in todo]
        regeneration = dataclasses.replace(regeneration, context=_max_model_len(config, target_config, [], prompts))
        context, total = regeneration.context, len(todo)
    else:
        records, stats = lib.read_records(config.data, tokenizer, config.max_length, config.chat_template,
                                          config.limit, config.skip_errors)
        todo = [r for r in records if r.id not in done]
        context, total = _max_model_len(config, target_config, todo, []), sum(len(r.input_ids) for r in todo)
    norm = vc.final_norm(target_dir, target_config, config.trust_remote_code)
    log.info("extract (vLLM %s): %d records stored already, %d to capture", engine.version, len(done), len(todo))
    counters = vc.CaptureCounters()
    if todo:
        (out / "manifest.json").unlink(missing_ok=True)
        writer = lib.open_writer(out, layout, 0, parallelism, shard_mb=config.shard_mb, batch_tokens=context,
                                 pin=False, fsync=config.fsync, stats=stats,
                                 metadata={"target": config.target, "dtype": config.dtype})
        counters = _capture(config, engine, options, target_dir, layers, norm, layout, writer, todo, total, context,
                            regeneration if config.regenerate else None, out, done)
    stats.update(backend="vllm", vllm=engine.version, tensor_parallel_size=config.tensor_parallel_size,
                 engine_layer_ids=list(layers.ids), tokens_extracted=counters.tokens,
                 seconds=round(counters.seconds, 2), engine_startup_seconds=round(counters.engine_startup_seconds, 2),
                 tokens_per_second=round(counters.tokens / max(counters.seconds, 1e-9), 1))
    if config.regenerate:
        stats.update(generated_tokens=counters.generated_tokens, finish_reasons=counters.finish_reasons)
    architecture = (getattr(target_config, "architectures", None) or ["unknown"])[0]
    lib.write_manifest_for(out, target_config, architecture, "vllm", layout, identity,
                           {"target": config.target, "world_size": 1, "data": list(config.data), "stats": stats,
                            "backend": "vllm",
                            "verification": {"backend": "vllm", "token_ids_equal_to_sent": counters.records}})
    return ExtractResult(out, stats)


def _spool(config: Config, out: Path) -> Path:
    """This store's spool folder (emptied at the start and deleted at the end of each run)."""
    import hashlib

    from eaglekit.vllm.capture import SPOOL

    if not config.spool_dir:
        return out / SPOOL
    return Path(config.spool_dir) / f".eaglekit-spool-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]}"


def _capture(config: Config, engine: Any, options: Any, target_dir: str, layers: Any, norm: Any, layout: Any,
             writer: Any, todo: list[Any], total: int, context: int, regeneration: Any, out: Path,
             done: set[str]) -> Any:
    """The engine session: every record of `todo` stored through `writer` (closed on success, aborted otherwise)."""
    from tqdm import tqdm

    from eaglekit.vllm import capture as vc
    from eaglekit.vllm import regenerate as vr

    job = {"model": target_dir, "layer_ids": list(layers.ids), "max_in_flight": options.max_in_flight,
           "max_spool": options.max_spool,
           "engine_args": vc.engine_arguments(engine, target_dir, options, context, config.regenerate)}
    env = vc.engine_environment(engine, options.tensor_parallel_size)
    window = options.max_in_flight + options.max_spool
    unit = "rec" if regeneration else "tok"
    try:
        with tqdm(total=total, unit=unit, unit_scale=True, desc="extract (vLLM)", smoothing=0.1) as bar, \
                vc.engine_session(engine, job, _spool(config, out), config.target, env,
                                  out / "vllm-capture.log") as session:
            if regeneration is None:
                counters = vc.capture_records(session, todo, layers, norm, layout, writer, window,
                                              lambda record: bar.update(len(record.input_ids)))
            else:
                with _kept_conversations(out / REGENERATED_FILE, done) as lines:
                    def stored(record: Any, line: dict[str, Any]) -> None:
                        lines.write(json.dumps(line, ensure_ascii=False) + "\n")
                        lines.flush()
                        bar.update(1)

                    counters = vr.regenerate_records(session, todo, regeneration, layers, norm, layout, writer,
                                                     window, stored)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return counters
