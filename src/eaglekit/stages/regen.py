"""Regenerate the assistant turns of a prompt set with the target (in-process, or an OpenAI-compatible server).

    eaglekit regen prompts.jsonl output=runs/regen target=meta-llama/Llama-3.1-8B-Instruct
    eaglekit regen prompts.jsonl output=runs/regen backend=openai servers=http://127.0.0.1:8000 concurrency=32

Multi-turn rule: system and user turns are kept in place and every original assistant turn is
dropped. An answer is generated after each run of user turns that the original answered (an
assistant turn follows it) and after a trailing user turn, each given the history with the
EARLIER REGENERATED answers, so the data is what the target itself would have said. `turns=first`
keeps the conversation up to its first answer only. A record without a user turn is skipped.

Outputs in `output/`: `conversations.jsonl` (append-only, one finished record per line, OpenAI
messages with `id` and a `regen` metadata object; flushed and fsynced per line), `failures.jsonl`
(records that failed; retried on the next run), `stats.json`, `config.yaml` (resolved, API key
redacted), `settings.json` (what a resumed run must match), `manifest.json` once every record is done.
The turn plan, the resumable JSONL files and the job loops are `eaglekit.generation.regen`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglekit.config import check_options, option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_json, file_sha256, write_manifest
from eaglekit.generation.backends import BackendError, HFBackend, OpenAIBackend, SamplingParams
from eaglekit.generation.regen import (
    FAILURES_FILE,
    OUTPUT_FILE,
    Pending,
    Progress,
    compact_failures,
    plan_turns,
    regen_hf,
    regen_openai,
    scan_finished,
)

if TYPE_CHECKING:
    from eaglekit.data import Conversation

log = logging.getLogger(__name__)

POSITIONAL = ("data",)
STATS_FILE, SETTINGS_FILE = "stats.json", "settings.json"
# options that change what is generated: a resumed run must match them
SETTINGS_KEYS = ("target", "model", "turns", "temperature", "top_p", "max_new_tokens", "seed", "chat_template")


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((), "prompt files or directories (OpenAI messages, ShareGPT, prompt/completion)")
    output: str = option("", "output directory (conversations.jsonl, failures.jsonl, stats.json, config.yaml)")
    backend: str = option("hf", "hf: the target in this process; openai: OpenAI-compatible servers",
                          choices=("hf", "openai"))
    target: str = option("", "target model directory, hub id or 'tiny' (hf backend; recorded as metadata for openai)")
    servers: tuple[str, ...] = option((), "openai backend: server URLs, used round-robin (http://host:port)")
    model: str = option("", "openai backend: model name to request (default: the first one /v1/models lists)")
    api_key: str = option("", "openai backend: API key (default: $OPENAI_API_KEY); never written to disk")
    turns: str = option("all", "answer every user turn, or only the first", choices=("all", "first"))
    temperature: float = option(0.0, "sampling temperature (0 = greedy)", min=0)
    top_p: float = option(1.0, "nucleus sampling cut (1 = off)", above=0, max=1)
    max_new_tokens: int = option(1024, "most tokens per generated answer", min=1)
    seed: int = option(0, "sampling seed; each record's seed is derived from it and the record id", min=0)
    batch_size: int = option(8, "hf backend: conversations generated together", min=1)
    concurrency: int = option(16, "openai backend: requests in flight at once", min=1)
    timeout: float = option(600.0, "openai backend: seconds before one request is abandoned (and retried)", above=0)
    retries: int = option(3, "openai backend: retries per request on connection errors, 5xx and garbage answers", min=0)
    backoff: float = option(1.0, "openai backend: seconds before the first retry, doubled for each next one", min=0)
    limit: int = option(0, "regenerate only the first N records of the data (0 = all)", min=0)
    skip_errors: bool = option(False, "skip malformed input records instead of stopping")
    device: str = option("auto", "hf backend: device (auto, cpu, cuda, cuda:1)")
    dtype: str = option("auto", "hf backend: dtype (auto = bf16 on GPU, fp32 on CPU)")
    chat_template: str = option("", "hf backend: chat template (Jinja text or file) instead of the tokenizer's own")
    trust_remote_code: bool = option(False, "allow the target's own modelling code (hf backend)")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by regen")


@dataclass
class RegenResult:
    output: Path
    stats: dict[str, Any]


def _settings(config: Config) -> dict[str, Any]:
    return {key: getattr(config, key) for key in SETTINGS_KEYS}


def _check_settings(config: Config, directory: Path) -> None:
    """A resumed run must generate the same way as the run that wrote the existing records (written once the backend
    is up)."""
    settings = _settings(config)
    path = directory / SETTINGS_FILE
    if path.is_file() and (directory / OUTPUT_FILE).is_file() and (directory / OUTPUT_FILE).stat().st_size > 0:
        old = {"chat_template": "", **json.loads(path.read_text())}  # written before chat_template was a setting
        changed = [f"{k}: {old.get(k)!r} -> {settings[k]!r}" for k in SETTINGS_KEYS if old.get(k) != settings[k]]
        if changed:
            raise EaglekitError(f"{directory} holds records generated with other settings ({'; '.join(changed)}); "
                                "use another output= directory, or restore those settings to resume")


def _read(config: Config) -> list[Conversation]:
    """The prompt records (the first `limit`), read before anything is written: bad input leaves no output."""
    from eaglekit.data import read_conversations

    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    return conversations[: config.limit] if config.limit > 0 else conversations


def _load_todo(config: Config, conversations: list[Conversation],
               finished: set[str]) -> tuple[list[Pending], int, int]:
    todo, skipped = [], 0
    for conversation in conversations:
        if conversation.id in finished:
            continue
        plan = plan_turns([{"role": m.role, "content": m.content} for m in conversation.messages], config.turns)
        if None not in plan:
            skipped += 1
            continue
        todo.append(Pending(conversation.id, plan))
    if skipped:
        log.warning("%d record(s) have no user turn to answer; skipped", skipped)
    return todo, len(conversations), skipped


def _validate(config: Config) -> None:
    check_options(config)  # each option within its declared range (the CLI's load_config checked them already)
    if not config.data:
        raise EaglekitError("no prompts given: eaglekit regen FILE.jsonl output=DIR ...")
    if not config.output:
        raise EaglekitError("no output directory given: pass output=DIR")
    if config.backend == "hf" and not config.target:
        raise EaglekitError("backend=hf needs target=PATH_OR_HUB_ID (or target=tiny); or use "
                            "backend=openai servers=URL")
    if config.backend == "openai" and not config.servers:
        raise EaglekitError("backend=openai needs servers=URL[,URL...], e.g. servers=http://127.0.0.1:8000")


def run(config: Config) -> RegenResult:
    from eaglekit.manifest import claim_output, write_errors

    _validate(config)
    conversations = _read(config)  # a malformed record stops the run here, before the output is made
    directory = claim_output(config.output, "regen", config.overwrite)
    with write_errors(directory, "regenerated records"):
        return _run(config, directory, conversations)


def _run(config: Config, directory: Path, conversations: list[Conversation]) -> RegenResult:
    _check_settings(config, directory)
    output = directory / OUTPUT_FILE
    todo, total, skipped = _load_todo(config, conversations, scan_finished(output))
    log.info("%d record(s): %d to generate, %d already done, %d without a user turn", total, len(todo),
             total - len(todo) - skipped, skipped)
    backend, meta = _backend(config, todo)  # a target or server that fails leaves no settings or config behind
    atomic_write_json(directory / SETTINGS_FILE, _settings(config))
    (directory / "manifest.json").unlink(missing_ok=True)  # written again only when every record is done
    save_resolved(dataclasses.replace(config, api_key="<redacted>" if config.api_key else ""), directory)
    meta.update(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens,
                seed=config.seed, turns=config.turns)
    progress = Progress(directory, len(todo), meta)
    sampling = SamplingParams(config.temperature, config.top_p, config.max_new_tokens, config.seed)
    try:
        if todo and config.backend == "hf":
            regen_hf(todo, progress, backend, sampling, config.batch_size)  # type: ignore[arg-type]
        elif todo:
            regen_openai(todo, progress, backend, sampling, config.concurrency)  # type: ignore[arg-type]
    finally:
        seconds = progress.close()
    capped = getattr(backend, "capped_answers", 0)
    if capped:
        log.warning("%d answer(s) were cut to the context their prompt leaves (max_new_tokens=%d does not fit the "
                    "target's %s-token context after those prompts)", capped, config.max_new_tokens,
                    backend.max_context)
    return _finish(config, directory, total, skipped, progress, seconds, capped)


def _backend(config: Config, todo: list[Pending]) -> tuple[Any, dict[str, Any]]:
    """The generating backend (None for the hf backend when nothing is left to do) and its metadata."""
    if config.backend == "hf":
        backend = (HFBackend.load(config.target, config.device, config.dtype, config.trust_remote_code,
                                  config.chat_template) if todo else None)
        return backend, {"backend": "hf", "model": config.target}
    backend = OpenAIBackend(config.servers, config.api_key or os.environ.get("OPENAI_API_KEY", ""), config.model,
                            config.concurrency, config.timeout, config.retries, config.backoff)
    try:
        return backend, {"backend": "openai", "model": backend.resolve_model() if todo else config.model}
    except BackendError as error:
        backend.close()
        raise EaglekitError(f"cannot ask {config.servers[0]} for its model ({error}); start the server, "
                            "fix servers=, or pass model=NAME") from None


def _finish(config: Config, directory: Path, total: int, skipped: int, progress: Progress, seconds: float,
            capped: int = 0) -> RegenResult:
    finished = scan_finished(directory / OUTPUT_FILE)
    outstanding = compact_failures(directory / FAILURES_FILE, finished)
    counts = progress.counts
    stats = {
        "records": total, "finished": len(finished), "skipped_no_user_turn": skipped, **counts,
        "outstanding_failures": len(outstanding), "finish_reasons": progress.finish_reasons, "capped_answers": capped,
        "seconds": round(seconds, 3),
        "records_per_second": round(counts["generated"] / seconds, 3) if seconds > 0 else 0.0,
        "completion_tokens_per_second": round(counts["completion_tokens"] / seconds, 3) if seconds > 0 else 0.0,
    }
    atomic_write_json(directory / STATS_FILE, stats)
    print(f"regen: {counts['generated']} generated, {len(finished)}/{total - skipped} done, {counts['failed']} failed, "
          f"{counts['completion_tokens']} tokens in {seconds:.1f}s ({stats['completion_tokens_per_second']:.1f} tok/s) "
          f"-> {directory / OUTPUT_FILE}")
    if outstanding:
        raise EaglekitError(_failure_message(outstanding, directory / FAILURES_FILE))
    write_manifest(directory, "regen", {"output": OUTPUT_FILE, "output_sha256": file_sha256(directory / OUTPUT_FILE),
                                        "records": len(finished),
                                        "settings": {k: getattr(config, k) for k in SETTINGS_KEYS}})
    return RegenResult(directory / OUTPUT_FILE, stats)


def _failure_message(outstanding: list[dict[str, Any]], path: Path) -> str:
    """What failed and what to do: a retry only when one can succeed (connection errors, out of memory)."""
    retryable = [e for e in outstanding if e.get("retryable", True)]
    first = (retryable or outstanding)[0]
    text = f"{len(outstanding)} record(s) failed (first: {first['id']}: {first['error']}); see {path}"
    if len(retryable) == len(outstanding):
        return text + "; re-run the same command to retry them"
    fixed = len(outstanding) - len(retryable)
    advice = (f"; {fixed} of them fail the same way on every run (the target rejects them as they are, e.g. a prompt "
              "longer than its context): shorten or drop those records")
    return text + advice + (f"; re-run the same command to retry the other {len(retryable)}" if retryable else "")
