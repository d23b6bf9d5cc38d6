"""The server's side of generation, free of the web framework: a validated request (`ChatRequest`) or the error a
client must fix (`RequestError`), a job per request, the bounded queue the worker takes compatible jobs from, and the
counters of `/metrics`. The worker thread calls `Job.emit`; the request's event loop awaits `Job.next_event`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """A request the client must fix; becomes an OpenAI-style JSON error with this HTTP status."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    max_tokens_given: bool = True  # False: the server's default, capped at the context the prompt leaves


@dataclass
class Job:
    """One queued generation. The worker reports ("tokens", ids)*, then ("done", EngineOutput) or ("error", message)."""

    prompt_ids: list[int]
    request: ChatRequest
    loop: asyncio.AbstractEventLoop | None = None  # the loop of the request waiting for this job
    cancelled: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def batch_key(self) -> tuple | None:
        """Jobs with equal keys may share one batched generate (greedy, or the same seeded sampling)."""
        r = self.request
        return None if r.stream else (r.max_tokens, r.temperature, r.top_p, r.seed if r.temperature > 0 else None)

    def emit(self, kind: str, value: Any) -> None:
        """From the worker thread: hand an event to the request's loop (dropped when that loop is gone)."""
        if self.loop is None:
            self.events.put_nowait((kind, value))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop was closed: the server stopped
            self.cancelled = True

    async def next_event(self) -> tuple[str, Any]:
        return await self.events.get()


class JobQueue:
    """A bounded FIFO from which the worker can take several compatible jobs at once."""

    def __init__(self, maxsize: int):
        self.maxsize, self.jobs, self.ready = maxsize, deque(), threading.Condition()

    def put(self, job: Job) -> bool:
        with self.ready:
            if len(self.jobs) >= self.maxsize:
                return False
            self.jobs.append(job)
            self.ready.notify()
            return True

    def take(self, max_jobs: int, timeout: float = 0.2) -> list[Job]:
        with self.ready:
            if not self.jobs and not self.ready.wait(timeout):
                return []
            if not self.jobs:
                return []
            first = self.jobs.popleft()
            taken, key = [first], first.batch_key()
            if key is not None:
                for job in [j for j in self.jobs if j.batch_key() == key][: max_jobs - 1]:
                    self.jobs.remove(job)
                    taken.append(job)
            return taken

    def drain(self) -> list[Job]:
        """Every waiting job, removed."""
        with self.ready:
            jobs = list(self.jobs)
            self.jobs.clear()
            return jobs

    def __len__(self) -> int:
        with self.ready:
            return len(self.jobs)


class Metrics:
    """Thread-safe counters for `/metrics`."""

    def __init__(self):
        self.lock, self.started = threading.Lock(), time.time()
        self.counts = {"requests": 0, "completed": 0, "failed": 0, "rejected_busy": 0, "bad_requests": 0,
                       "cancelled": 0, "prompt_tokens": 0, "completion_tokens": 0, "generate_seconds": 0.0}

    def add(self, **deltas: float) -> None:
        with self.lock:
            for key, value in deltas.items():
                self.counts[key] += value

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            data = dict(self.counts)
        data["uptime_seconds"] = round(time.time() - self.started, 3)
        busy = data["generate_seconds"]
        data["completion_tokens_per_second"] = round(data["completion_tokens"] / busy, 3) if busy > 0 else 0.0
        return data
