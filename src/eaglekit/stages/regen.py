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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from eaglekit.config import option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_json, atomic_write_text, file_sha256, write_manifest
from eaglekit.target.backends import BackendError, Generation, HFBackend, OpenAIBackend, SamplingParams

log = logging.getLogger(__name__)

POSITIONAL = ("data",)
OUTPUT_FILE, FAILURES_FILE, STATS_FILE, SETTINGS_FILE = "conversations.jsonl", "failures.jsonl", "stats.json", "settings.json"
# options that change what is generated: a resumed run must match them
SETTINGS_KEYS = ("target", "model", "turns", "temperature", "top_p", "max_new_tokens", "seed")


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((), "prompt files or directories (OpenAI messages, ShareGPT, prompt/completion)")
    output: str = option("", "output directory (conversations.jsonl, failures.jsonl, stats.json, config.yaml)")
    backend: str = option("hf", "hf: the target in this process; openai: OpenAI-compatible servers", choices=("hf", "openai"))
    target: str = option("", "target model directory, hub id or 'tiny' (hf backend; recorded as metadata for openai)")
    servers: tuple[str, ...] = option((), "openai backend: server URLs, used round-robin (http://host:port)")
    model: str = option("", "openai backend: model name to request (default: the first one /v1/models lists)")
    api_key: str = option("", "openai backend: API key (default: $OPENAI_API_KEY); never written to disk")
    turns: str = option("all", "answer every user turn, or only the first", choices=("all", "first"))
    temperature: float = option(0.0, "sampling temperature (0 = greedy)")
    top_p: float = option(1.0, "nucleus sampling cut (1 = off)")
    max_new_tokens: int = option(1024, "most tokens per generated answer")
    seed: int = option(0, "sampling seed; each record's seed is derived from it and the record id")
    batch_size: int = option(8, "hf backend: conversations generated together")
    concurrency: int = option(16, "openai backend: requests in flight at once")
    timeout: float = option(600.0, "openai backend: seconds before one request is abandoned (and retried)")
    retries: int = option(3, "openai backend: retries per request on connection errors, 5xx and garbage answers")
    backoff: float = option(1.0, "openai backend: seconds before the first retry, doubled for each next one")
    limit: int = option(0, "regenerate only the first N records of the data (0 = all)")
    skip_errors: bool = option(False, "skip malformed input records instead of stopping")
    device: str = option("auto", "hf backend: device (auto, cpu, cuda, cuda:1)")
    dtype: str = option("auto", "hf backend: dtype (auto = bf16 on GPU, fp32 on CPU)")
    trust_remote_code: bool = option(False, "allow the target's own modelling code (hf backend)")


@dataclass
class RegenResult:
    output: Path
    stats: dict[str, Any]


# ----------------------------------------------------------------------------- turn planning (pure)


def plan_turns(messages: list[dict[str, str]], turns: str = "all") -> list[dict[str, str] | None]:
    """Messages with original answers dropped and `None` where an answer is to be generated."""
    plan: list[dict[str, str] | None] = []
    for message in messages:
        if message["role"] != "assistant":
            plan.append(message)
        elif plan and plan[-1] is not None and plan[-1]["role"] == "user":
            plan.append(None)  # answered user turn: regenerate its answer
    if plan and plan[-1] is not None and plan[-1]["role"] == "user":
        plan.append(None)  # trailing prompt
    if turns == "first" and None in plan:
        plan = plan[: plan.index(None) + 1]
    return plan


class Pending:
    """A conversation being regenerated: its plan, filled in answer by answer."""

    def __init__(self, record_id: str, plan: list[dict[str, Any] | None]):
        self.id, self.plan = record_id, plan
        self.prompt_tokens: list[int] = []
        self.completion_tokens: list[int] = []
        self.finish_reasons: list[str] = []

    def next_prompt(self) -> list[dict[str, str]] | None:
        """History up to the next answer to generate, or None when all are filled."""
        if None not in self.plan:
            return None
        cut = self.plan.index(None)
        return [{"role": m["role"], "content": m["content"]} for m in self.plan[:cut]]  # type: ignore[index]

    def fill(self, answer: Generation) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        self.plan[self.plan.index(None)] = message
        self.prompt_tokens.append(answer.prompt_tokens)
        self.completion_tokens.append(answer.completion_tokens)
        self.finish_reasons.append(answer.finish_reason)

    def record(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "messages": self.plan, "regen": {**meta, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "finish_reasons": self.finish_reasons}}


def record_seed(seed: int, record_id: str) -> int:
    """A per-record seed that does not depend on batch composition or order."""
    return (seed + zlib.crc32(record_id.encode())) % (2 ** 31)


# ----------------------------------------------------------------------------- append-only JSONL


def scan_finished(path: Path, key: str = "id") -> set[str]:
    """Ids in an append-only JSONL file. A partial last line (a crash mid-write) is cut off the file.

    Each record is written with one `write` ending in a newline, so only an interrupted write leaves a
    line without one; a newline-terminated line that is not a record means the file was damaged.
    """
    if not path.is_file():
        return set()
    ids: set[str] = set()
    good_end = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.endswith(b"\n"):
                log.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", path, len(raw))
                break
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or key not in record:
                raise EaglekitError(f"{path} line {number} is not a finished record (edited or corrupted?); "
                                    "remove that line and re-run")
            ids.add(str(record[key]))
            good_end += len(raw)
    if good_end < path.stat().st_size:
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    return ids


class JsonlAppender:
    """Appends one JSON object per line, flushed and fsynced, so a crash loses at most the line being written."""

    def __init__(self, path: Path):
        self.handle = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


# ----------------------------------------------------------------------------- the run


class _Progress:
    """Writes finished and failed records, counts tokens, drives the progress bar."""

    def __init__(self, directory: Path, total: int, meta: dict[str, Any]):
        self.meta, self.start = meta, time.perf_counter()
        self.output = JsonlAppender(directory / OUTPUT_FILE)
        self.failures = JsonlAppender(directory / FAILURES_FILE)
        self.counts = {"generated": 0, "failed": 0, "answers": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self.finish_reasons: dict[str, int] = {}
        self.first_error: str | None = None
        self.bar = tqdm(total=total, desc="regen", unit=" records", dynamic_ncols=True, disable=None)

    def finish(self, pending: Pending) -> None:
        self.output.write(pending.record(self.meta))
        self.counts["generated"] += 1
        self.counts["answers"] += len(pending.completion_tokens)
        self.counts["prompt_tokens"] += sum(pending.prompt_tokens)
        self.counts["completion_tokens"] += sum(pending.completion_tokens)
        for reason in pending.finish_reasons:
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self._tick()

    def fail(self, pending: Pending, error: Exception) -> None:
        self.failures.write({"id": pending.id, "error": str(error), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.counts["failed"] += 1
        self.first_error = self.first_error or f"{pending.id}: {error}"
        self._tick()

    def _tick(self) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tok_s=f"{self.counts['completion_tokens'] / elapsed:.1f}", failed=self.counts["failed"])
        self.bar.update(1)

    def close(self) -> float:
        self.bar.close()
        self.output.close()
        self.failures.close()
        return time.perf_counter() - self.start


def _params(config: Config, seed: int) -> SamplingParams:
    return SamplingParams(config.temperature, config.top_p, config.max_new_tokens, seed)


def _regen_hf(config: Config, todo: list[Pending], progress: _Progress, backend: HFBackend) -> None:
    import torch

    todo = sorted(todo, key=lambda p: len(json.dumps(p.next_prompt())))  # similar lengths share a batch: less padding
    for start in range(0, len(todo), config.batch_size):
        active = todo[start: start + config.batch_size]
        while active:
            prompts = [p.next_prompt() for p in active]
            try:
                results = backend.generate_batch(prompts, _params(config, record_seed(config.seed, active[0].id)))
            except torch.cuda.OutOfMemoryError:
                results = [BackendError(f"out of memory at batch_size={config.batch_size}; lower batch_size")] * len(active)
            still = []
            for pending, result in zip(active, results):
                if isinstance(result, BackendError):
                    progress.fail(pending, result)
                    continue
                pending.fill(result)
                if pending.next_prompt() is None:
                    progress.finish(pending)
                else:
                    still.append(pending)  # another turn to answer in the next round
            active = still


def _regen_openai(config: Config, todo: list[Pending], progress: _Progress, backend: OpenAIBackend) -> None:
    def one(pending: Pending) -> Pending:
        while (prompt := pending.next_prompt()) is not None:
            pending.fill(backend.chat(prompt, _params(config, record_seed(config.seed, pending.id))))
        return pending

    queue: Iterator[Pending] = iter(todo)
    pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="regen")
    running: dict[Future, Pending] = {}
    try:
        while True:
            while len(running) < 2 * config.concurrency and (pending := next(queue, None)) is not None:
                running[pool.submit(one, pending)] = pending
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                pending = running.pop(future)
                try:
                    progress.finish(future.result())
                except BackendError as error:
                    progress.fail(pending, error)
    finally:
        backend.close()  # in-flight requests give up at once on Ctrl-C or a fatal error
        pool.shutdown(wait=True, cancel_futures=True)


def _check_settings(config: Config, directory: Path) -> None:
    """A resumed run must generate the same way as the run that wrote the existing records."""
    settings = {key: getattr(config, key) for key in SETTINGS_KEYS}
    path = directory / SETTINGS_FILE
    if path.is_file() and (directory / OUTPUT_FILE).is_file() and (directory / OUTPUT_FILE).stat().st_size > 0:
        old = json.loads(path.read_text())
        changed = [f"{k}: {old.get(k)!r} -> {settings[k]!r}" for k in SETTINGS_KEYS if old.get(k) != settings[k]]
        if changed:
            raise EaglekitError(f"{directory} holds records generated with other settings ({'; '.join(changed)}); "
                                "use another output= directory, or restore those settings to resume")
    atomic_write_json(path, settings)


def _load_todo(config: Config, finished: set[str]) -> tuple[list[Pending], int, int]:
    from eaglekit.data import read_conversations

    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    if config.limit > 0:
        conversations = conversations[: config.limit]
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
    if not config.data:
        raise EaglekitError("no prompts given: eaglekit regen FILE.jsonl output=DIR ...")
    if not config.output:
        raise EaglekitError("no output directory given: pass output=DIR")
    if config.backend == "hf" and not config.target:
        raise EaglekitError("backend=hf needs target=PATH_OR_HUB_ID (or target=tiny); or use backend=openai servers=URL")
    if config.backend == "openai" and not config.servers:
        raise EaglekitError("backend=openai needs servers=URL[,URL...], e.g. servers=http://127.0.0.1:8000")
    if config.max_new_tokens < 1 or config.batch_size < 1 or config.concurrency < 1:
        raise EaglekitError("max_new_tokens, batch_size and concurrency must be >= 1")
    if config.temperature < 0 or not 0 < config.top_p <= 1:
        raise EaglekitError("temperature must be >= 0 and top_p in (0, 1]")


def _compact_failures(path: Path, finished: set[str]) -> list[dict[str, Any]]:
    """Keep the latest failure of each record still not finished (atomically)."""
    latest: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial line from a crash
        if isinstance(entry, dict) and str(entry.get("id")) not in finished:
            latest[str(entry.get("id"))] = entry
    atomic_write_text(path, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in latest.values()))
    return list(latest.values())


def run(config: Config) -> RegenResult:
    _validate(config)
    directory = Path(config.output)
    directory.mkdir(parents=True, exist_ok=True)
    _check_settings(config, directory)
    (directory / "manifest.json").unlink(missing_ok=True)  # written again only when every record is done
    save_resolved(dataclasses.replace(config, api_key="<redacted>" if config.api_key else ""), directory)
    output = directory / OUTPUT_FILE
    todo, total, skipped = _load_todo(config, scan_finished(output))
    log.info("%d record(s): %d to generate, %d already done, %d without a user turn", total, len(todo),
             total - len(todo) - skipped, skipped)
    backend: HFBackend | OpenAIBackend
    if config.backend == "hf":
        backend = HFBackend.load(config.target, config.device, config.dtype, config.trust_remote_code) if todo else None  # type: ignore[assignment]
        meta = {"backend": "hf", "model": config.target}
    else:
        backend = OpenAIBackend(config.servers, config.api_key or os.environ.get("OPENAI_API_KEY", ""), config.model,
                                config.concurrency, config.timeout, config.retries, config.backoff)
        try:
            meta = {"backend": "openai", "model": backend.resolve_model() if todo else config.model}
        except BackendError as error:
            backend.close()
            raise EaglekitError(f"cannot ask {config.servers[0]} for its model ({error}); start the server, "
                                "fix servers=, or pass model=NAME") from None
    meta.update(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens,
                seed=config.seed, turns=config.turns)
    progress = _Progress(directory, len(todo), meta)
    try:
        if todo:
            (_regen_hf if config.backend == "hf" else _regen_openai)(config, todo, progress, backend)  # type: ignore[arg-type]
    finally:
        seconds = progress.close()
    return _finish(config, directory, total, skipped, progress, seconds)


def _finish(config: Config, directory: Path, total: int, skipped: int, progress: _Progress, seconds: float) -> RegenResult:
    finished = scan_finished(directory / OUTPUT_FILE)
    outstanding = _compact_failures(directory / FAILURES_FILE, finished)
    counts = progress.counts
    stats = {
        "records": total, "finished": len(finished), "skipped_no_user_turn": skipped, **counts,
        "outstanding_failures": len(outstanding), "finish_reasons": progress.finish_reasons,
        "seconds": round(seconds, 3),
        "records_per_second": round(counts["generated"] / seconds, 3) if seconds > 0 else 0.0,
        "completion_tokens_per_second": round(counts["completion_tokens"] / seconds, 3) if seconds > 0 else 0.0,
    }
    atomic_write_json(directory / STATS_FILE, stats)
    print(f"regen: {counts['generated']} generated, {len(finished)}/{total - skipped} done, {counts['failed']} failed, "
          f"{counts['completion_tokens']} tokens in {seconds:.1f}s ({stats['completion_tokens_per_second']:.1f} tok/s) "
          f"-> {directory / OUTPUT_FILE}")
    if outstanding:
        raise EaglekitError(f"{len(outstanding)} record(s) failed (first: {progress.first_error or outstanding[0]['error']}); "
                            f"see {directory / FAILURES_FILE}; re-run the same command to retry them")
    write_manifest(directory, "regen", {"output": OUTPUT_FILE, "output_sha256": file_sha256(directory / OUTPUT_FILE),
                                        "records": len(finished), "settings": {k: getattr(config, k) for k in SETTINGS_KEYS}})
    return RegenResult(directory / OUTPUT_FILE, stats)
