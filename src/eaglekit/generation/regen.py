"""Regenerating conversations: the turn plan (which answers to generate), the append-only JSONL files that make a
run resumable, progress accounting, and the two job loops (batches in-process, concurrent requests to servers).

`eaglekit.stages.regen` parses and validates the options, checks a resumed run's settings and calls these.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_text
from eaglekit.generation.backends import BackendError, Generation, HFBackend, OpenAIBackend, SamplingParams

log = logging.getLogger(__name__)

OUTPUT_FILE, FAILURES_FILE = "conversations.jsonl", "failures.jsonl"


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


# ----------------------------------------------------------------------------- progress and the job loops


class Progress:
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
        self.failures.write({"id": pending.id, "error": str(error), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "retryable": getattr(error, "retryable", True)})
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


def _record_params(sampling: SamplingParams, record_id: str) -> SamplingParams:
    return dataclasses.replace(sampling, seed=record_seed(sampling.seed or 0, record_id))


def regen_hf(todo: list[Pending], progress: Progress, backend: HFBackend, sampling: SamplingParams,
             batch_size: int) -> None:
    """Batches of `batch_size` conversations, similar lengths together; each round answers every batch member's
    next turn (the seed of a batch is its first record's)."""
    import torch

    todo = sorted(todo, key=lambda p: len(json.dumps(p.next_prompt())))  # similar lengths share a batch: less padding
    for start in range(0, len(todo), batch_size):
        active = todo[start: start + batch_size]
        while active:
            prompts = [p.next_prompt() for p in active]
            try:
                results = backend.generate_batch(prompts, _record_params(sampling, active[0].id))
            except torch.cuda.OutOfMemoryError:
                results = [BackendError(f"out of memory at batch_size={batch_size}; lower batch_size")] * len(active)
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


def regen_openai(todo: list[Pending], progress: Progress, backend: OpenAIBackend, sampling: SamplingParams,
                 concurrency: int) -> None:
    """One thread per conversation in flight (`concurrency` at once, twice that queued); closes the backend."""
    def one(pending: Pending) -> Pending:
        while (prompt := pending.next_prompt()) is not None:
            pending.fill(backend.chat(prompt, _record_params(sampling, pending.id)))
        return pending

    queue: Iterator[Pending] = iter(todo)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regen")
    running: dict[Future, Pending] = {}
    try:
        while True:
            while len(running) < 2 * concurrency and (pending := next(queue, None)) is not None:
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


def compact_failures(path: Path, finished: set[str]) -> list[dict[str, Any]]:
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
