"""`eaglekit extract backend=vllm`: the engine session that has vLLM's `extract_hidden_states` capture a store (and,
with `regenerate=true`, answer each record's prompt first), written through the same shard writer as `backend=hf`.

`eaglekit.stages.extract` parses the options and calls `capture_store(config)`; the pieces: the engine's layers and
job (`capture`), the regeneration requests (`regenerate`), the engine itself (`engine`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from eaglekit.config import save_resolved
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)


def read_target_config(config: Any) -> Any:
    """The target's HF config; for a class transformers lacks (vLLM may still serve it), config.json as a config."""
    from eaglekit.targets.loading import load_target_config, local_model_dir

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


def engine_options(config: Any) -> Any:
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


def max_model_len(config: Any, target_config: Any, records: list[Any], prompts: list[int]) -> int:
    """Tokens the engine must hold per request: the longest record (+1 sampled token), or the longest prompt with
    its answer and the template's tail (an answer whose text re-encodes longer is cut to fit:
    `regenerate.fitting_answer`); never over the target's own context. A `max_model_len` in `vllm_engine_args`
    is the engine's, so regeneration sizes its answers by it."""
    from eaglekit.vllm.regenerate import TEMPLATE_TAIL
    from eaglekit.targets.capture import text_config

    context = int(getattr(text_config(target_config), "max_position_embeddings", 0) or 1 << 30)
    if config.regenerate:
        given = engine_options(config).engine_args.get("max_model_len")
        if given:
            return int(given)
        return min(context, max(prompts, default=1) + config.max_new_tokens + TEMPLATE_TAIL)
    longest = max((len(r.input_ids) for r in records), default=1)
    if longest + 1 > context:
        raise EaglekitError(f"a record has {longest} tokens, more than the target's context of {context} allows; "
                            f"lower max_length to {context - 1}")
    return longest + 1


REGENERATED_FILE = "regenerated.jsonl"


def regeneration_data(config: Any, tokenizer: Any, done: set[str]) -> tuple[list[Any], Any, dict[str, int]]:
    """The conversations still to answer and how to answer them."""
    from eaglekit.data import read_conversations
    from eaglekit.data.tokenize import resolve_chat_template
    from eaglekit.vllm.regenerate import Regeneration

    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    conversations = conversations[: config.limit] if config.limit else conversations
    usable = [c for c in conversations if any(m.role == "user" for m in c.messages)]
    if not usable:
        raise EaglekitError(f"no conversation in {', '.join(config.data)} has a user turn to answer")
    eos = eos_ids(config.target, tokenizer)
    regeneration = Regeneration(tokenizer, resolve_chat_template(tokenizer, config.chat_template or None),
                                config.max_length, config.max_new_tokens, config.temperature, config.seed, eos, 0)
    stats = {"records_read": len(conversations), "no_user_turn": len(conversations) - len(usable)}
    return [c for c in usable if c.id not in done], regeneration, stats


def eos_ids(target: str, tokenizer: Any) -> tuple[int, ...]:
    """What ends an answer, as `regen backend=hf` reads it: generation_config's eos ids, then the tokenizer's."""
    from transformers import GenerationConfig

    from eaglekit.targets.loading import local_model_dir

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


def kept_conversations(path: Path, done: set[str]) -> Any:
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


def capture_store(config: Any) -> tuple[Path, dict[str, Any]]:
    import dataclasses

    from eaglekit.vllm import capture as vc
    from eaglekit.vllm import engine as ve
    from eaglekit.vllm import regenerate as vr
    from eaglekit.manifest import claim_output
    from eaglekit.targets import extract as lib
    from eaglekit.targets.capture import text_config
    from eaglekit.targets.loading import load_tokenizer, local_model_dir
    from eaglekit.targets.shard_writer import writer_parallelism
    from eaglekit.vllm.support import check_captured

    options = engine_options(config)
    parallelism = writer_parallelism(config.writer_threads, config.buffers)
    target_dir = local_model_dir(config.target)
    target_config = read_target_config(config)
    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    num_layers = int(getattr(text_config(target_config), "num_hidden_layers", 0) or 0)
    aux_ids = lib.resolve_aux_ids(config.aux_layer_ids, config.aux_layer_convention, num_layers, config.target)
    layers = vc.engine_layers(aux_ids, num_layers, ve.target_facts(target_dir)["mla"])  # before vLLM is touched
    engine = ve.find_engine(options.python, options.version_check)  # vLLM missing or another version
    check_captured(engine, target_dir)  # a target this vLLM will not capture from: before the engine, nothing written
    out = claim_output(Path(config.output), "extract", config.overwrite)
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
        todo, regeneration, stats = regeneration_data(config, tokenizer, done)
        prompts = [len(vr.prompt_ids(regeneration, vr.prompt_of(c))) for c in todo]
        regeneration = dataclasses.replace(regeneration, context=max_model_len(config, target_config, [], prompts))
        context, total = regeneration.context, len(todo)
    else:
        records, stats = lib.read_records(config.data, tokenizer, config.max_length, config.chat_template,
                                          config.limit, config.skip_errors)
        todo = [r for r in records if r.id not in done]
        context, total = max_model_len(config, target_config, todo, []), sum(len(r.input_ids) for r in todo)
    norm = vc.final_norm(target_dir, target_config, config.trust_remote_code)
    log.info("extract (vLLM %s): %d records stored already, %d to capture", engine.version, len(done), len(todo))
    counters = vc.CaptureCounters()
    if todo:
        (out / "manifest.json").unlink(missing_ok=True)
        writer = lib.open_writer(out, layout, 0, parallelism, shard_mb=config.shard_mb, batch_tokens=context,
                                 pin=False, fsync=config.fsync, stats=stats,
                                 metadata={"target": config.target, "dtype": config.dtype})
        counters = run_session(config, engine, options, target_dir, layers, norm, layout, writer, todo, total, context,
                            regeneration if config.regenerate else None, out, done)
    stats.update(backend="vllm", vllm=engine.version, tensor_parallel_size=config.tensor_parallel_size,
                 engine_layer_ids=list(layers.ids), tokens_extracted=counters.tokens,
                 seconds=round(counters.seconds, 2), engine_startup_seconds=round(counters.engine_startup_seconds, 2),
                 tokens_per_second=round(counters.tokens / max(counters.seconds, 1e-9), 1))
    if config.regenerate:
        stats.update(generated_tokens=counters.generated_tokens, finish_reasons=counters.finish_reasons,
                     answers_cut_to_fit_context=counters.answers_cut)
    architecture = (getattr(target_config, "architectures", None) or ["unknown"])[0]
    lib.write_manifest_for(out, target_config, architecture, "vllm", layout, identity,
                           {"target": config.target, "world_size": 1, "data": list(config.data), "stats": stats,
                            "backend": "vllm",
                            "verification": {"backend": "vllm", "token_ids_equal_to_sent": counters.records}})
    return out, stats


def spool_folder(config: Any, out: Path) -> Path:
    """This store's spool folder (emptied at the start and deleted at the end of each run)."""
    import hashlib

    from eaglekit.vllm.capture import SPOOL

    if not config.spool_dir:
        return out / SPOOL
    return Path(config.spool_dir) / f".eaglekit-spool-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]}"


def run_session(config: Any, engine: Any, options: Any, target_dir: str, layers: Any, norm: Any, layout: Any,
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
                vc.engine_session(engine, job, spool_folder(config, out), config.target, env,
                                  out / "vllm-capture.log") as session:
            if regeneration is None:
                counters = vc.capture_records(session, todo, layers, norm, layout, writer, window,
                                              lambda record: bar.update(len(record.input_ids)))
            else:
                with kept_conversations(out / REGENERATED_FILE, done) as lines:
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
