"""An OpenAI-compatible HTTP server over a generation engine (the target in-process, or speculative with a drafter),
on FastAPI + uvicorn.

Routes: `GET /v1/models`, `POST /v1/chat/completions` (JSON, or SSE `data:` chunks ending in `data: [DONE]` when
`"stream": true`), `GET /metrics` (JSON counters plus the engine's own stats), `GET /health`. Errors are
OpenAI-shaped JSON (`{"error": {"message", "type", "code", "param"}}`): 400 for a malformed request (the pydantic
models of `eaglekit.generation.server_api` say what is accepted), 401 for a wrong API key, 404 for an unknown model or
route, 413 for an oversized body, 503 when the request queue is full, 500 when the engine fails.

Generation is a blocking PyTorch call on one device, so ONE worker thread drains a bounded queue of jobs
(`eaglekit.generation.server_jobs`) and reports each job's tokens back to the event loop that serves its request; queued
non-streaming requests with equal sampling settings are generated as one batch. A client that leaves a stream cancels
its generation at the next token. It is meant for local use (127.0.0.1 by default); put a real proxy in front of it
before exposing it.

Engine interface (`GenerationEngine`): `encode_chat(messages) -> list[int]`, `decode(ids) -> str`, `text_stream()
-> TextStream` (a streamed answer's text as its tokens arrive, each token decoded once:
`eaglekit.generation.server_text`),
`max_context: int | None`, `generate(prompt_ids, max_new_tokens, temperature, top_p, seed, on_tokens=None) ->
EngineOutput` (`on_tokens(new_ids)` is called as tokens are produced; it may raise `GenerationCancelled`),
`metrics() -> dict` (cumulative stats shown under `/metrics` "engine"), and optionally
`generate_many(prompts, max_new_tokens, temperature, top_p, seed) -> list[EngineOutput]` for batches.
`EngineOutput.stats` of a request is merged into that response's `usage`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Protocol

from eaglekit.errors import EaglekitError
from eaglekit.generation.backends import EngineOutput, GenerationCancelled
from eaglekit.generation.server_jobs import ChatRequest, Job, JobQueue, Metrics, RequestError
from eaglekit.generation.server_text import TextStream

log = logging.getLogger(__name__)

__all__ = ["ChatRequest", "ChatServer", "GenerationEngine", "RequestError"]  # and parse_chat_request (lazily)


def __getattr__(name: str) -> Any:
    if name == "parse_chat_request":  # with the web framework, imported when first asked for
        from eaglekit.generation.server_api import parse_chat_request

        return parse_chat_request
    raise AttributeError(f"module 'eaglekit.generation.server' has no attribute {name!r}")


class GenerationEngine(Protocol):
    max_context: int | None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def text_stream(self) -> TextStream: ...
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, on_tokens: Any = None) -> EngineOutput: ...
    def metrics(self) -> dict[str, Any]: ...


class ChatServer:
    """The served engine: one worker thread draining a bounded queue, uvicorn serving the FastAPI app."""

    def __init__(self, engine: GenerationEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str = "", queue_size: int = 64, max_batch_size: int = 8, default_max_tokens: int = 512,
                 max_tokens_limit: int = 4096):
        if queue_size < 1 or max_batch_size < 1:
            raise EaglekitError("queue_size and max_batch_size must be >= 1")
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens, self.max_tokens_limit = default_max_tokens, max_tokens_limit
        self.max_batch_size = max_batch_size
        self.capped_warned = False  # the default max_tokens was cut to the context left (warned once)
        self.jobs, self.metrics, self.created = JobQueue(queue_size), Metrics(), int(time.time())
        import uvicorn

        from eaglekit.generation.server_api import build_app

        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.socket = socket.create_server((host, port), family=family)
        except OSError as error:
            raise EaglekitError(f"cannot listen on {host}:{port} ({error}); pick another port=") from None
        self.app = build_app(self)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                                     lifespan="off", timeout_graceful_shutdown=5))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> "ChatServer":
        """Serve in background threads (tests, notebooks); `shutdown()` stops them."""
        self._threads = [threading.Thread(target=self._work, name="eaglekit-engine", daemon=True),
                         threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                          name="eaglekit-http", daemon=True)]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and self._threads[1].is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.uvicorn.started:
            raise EaglekitError(f"the HTTP server did not start on {self.url}")
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl-C."""
        worker = threading.Thread(target=self._work, name="eaglekit-engine", daemon=True)
        worker.start()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stop_worker()
            self.socket.close()

    def shutdown(self) -> None:
        """Stop serving (open requests get up to 5 s), then the worker; requests still queued get an error."""
        self.uvicorn.should_exit = True
        for thread in self._threads:
            if thread.name == "eaglekit-http":
                thread.join(timeout=30)
        self._stop_worker()
        for thread in self._threads:
            thread.join(timeout=30)
        self.socket.close()

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def metrics_snapshot(self) -> dict[str, Any]:
        data = self.metrics.snapshot()
        data["queue_depth"] = len(self.jobs)
        data["model"] = self.model_name
        data["engine"] = self.engine.metrics()
        return data

    def model_card(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "eaglekit"}]}

    # ------------------------------------------------------------------ worker
    def _stop_worker(self) -> None:
        self._stop.set()
        for job in self.jobs.drain():  # requests still waiting get an answer instead of hanging
            job.emit("error", "the server is shutting down")

    def _work(self) -> None:
        while not self._stop.is_set():
            jobs = [j for j in self.jobs.take(self.max_batch_size) if not j.cancelled]
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        r, start = jobs[0].request, time.perf_counter()
        try:
            if len(jobs) > 1:
                outputs = self.engine.generate_many(  # type: ignore[attr-defined]
                    [j.prompt_ids for j in jobs], r.max_tokens, r.temperature, r.top_p, r.seed)
            else:
                job = jobs[0]
                outputs = [self.engine.generate(job.prompt_ids, r.max_tokens, r.temperature, r.top_p, r.seed,
                                                on_tokens=_streamer(job) if r.stream else None)]
        except GenerationCancelled:
            self.metrics.add(cancelled=1)
            return
        except Exception as error:  # noqa: BLE001 - an engine failure answers 500 and the server keeps serving
            log.exception("generation failed")
            self.metrics.add(failed=len(jobs))
            for job in jobs:
                job.emit("error", f"{type(error).__name__}: {error}")
            return
        self.metrics.add(generate_seconds=time.perf_counter() - start, completed=len(jobs),
                         prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
                         completion_tokens=sum(len(o.ids) for o in outputs))
        for job, out in zip(jobs, outputs):
            job.emit("done", out)

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The prompt's token ids; caps a default max_tokens at the context left, refuses what does not fit."""
        try:
            prompt_ids = self.engine.encode_chat(request.messages)
        except Exception as error:  # noqa: BLE001 - chat templates raise anything (jinja TemplateError, ValueError)
            raise RequestError(400, f"the chat template rejected these messages: {error}", "invalid_messages",
                               "messages") from None
        limit = self.engine.max_context
        left = None if limit is None else limit - len(prompt_ids)
        if left is not None and not request.max_tokens_given and 0 < left < request.max_tokens:
            request.max_tokens = left  # no max_tokens asked for: what the context leaves
            if not self.capped_warned:
                self.capped_warned = True
                log.warning("a request without max_tokens got %d new tokens at most, not the default %d: its prompt "
                            "of %d tokens leaves no more of the model's %d-token context (logged once)",
                            request.max_tokens, self.default_max_tokens, len(prompt_ids), limit)
        if limit is not None and len(prompt_ids) + request.max_tokens > limit:
            raise RequestError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                                    f"the model's context of {limit} tokens", "context_length_exceeded", "messages")
        return prompt_ids


def _streamer(job: Job):
    def on_tokens(ids: list[int]) -> None:
        if job.cancelled:
            raise GenerationCancelled()
        job.emit("tokens", ids)
    return on_tokens
