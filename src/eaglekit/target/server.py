"""A small OpenAI-compatible HTTP server over a generation engine (the target in-process, later a drafter).

Routes: `GET /v1/models`, `POST /v1/chat/completions` (JSON, or SSE `data:` chunks ending in
`data: [DONE]` when `"stream": true`), `GET /metrics` (JSON counters plus the engine's own stats),
`GET /health`. Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "code"}}`): 400 for a
malformed request, 401 for a wrong API key, 404 for an unknown model or route, 413 for an oversized
body, 503 when the request queue is full.

Why the standard library's `ThreadingHTTPServer` and not FastAPI + uvicorn: generation here is a
blocking PyTorch call on one device, so the server is a thread per connection feeding ONE worker
thread through a bounded queue. That needs no event loop, no new dependencies, starts in a test
thread in milliseconds, and SSE is a few `write`s. It is meant for local use (127.0.0.1 by default);
put a real proxy in front of it before exposing it.

Engine interface (what `--drafter` will implement): any object with
  `encode_chat(messages) -> list[int]`, `decode(ids) -> str`, `max_context: int | None`,
  `generate(prompt_ids, max_new_tokens, temperature, top_p, seed, on_tokens=None) -> EngineOutput`
  (`on_tokens(new_ids)` is called as tokens are produced; it may raise `GenerationCancelled`),
  `metrics() -> dict` (cumulative stats shown under `/metrics` "engine"),
and optionally `generate_many(prompts, max_new_tokens, temperature, top_p, seed) -> list[EngineOutput]`
to batch queued non-streaming requests with equal sampling settings. `EngineOutput.stats` of a
request is merged into that response's `usage`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from eaglekit.errors import EaglekitError
from eaglekit.target.backends import EngineOutput, GenerationCancelled

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
ROLES = ("system", "user", "assistant")


class GenerationEngine(Protocol):
    max_context: int | None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, on_tokens: Any = None) -> EngineOutput: ...
    def metrics(self) -> dict[str, Any]: ...


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


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"'{key}' must be a number", param=key)
    if value > high or value < low or (low_open and value == low):
        raise RequestError(400, f"'{key}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=key)
    return float(value)


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{index}] must be an object", param="messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise RequestError(400, f"messages[{index}].content parts must all be {{type: text, text: str}}", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{index}].content must be a string", param="messages")
        out.append({"role": role, "content": content})
    return out


def parse_chat_request(body: Any, model_name: str, default_max_tokens: int, max_tokens_limit: int) -> ChatRequest:
    """Validate a `/v1/chat/completions` body; RequestError names the offending field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if "model" in body and body["model"] not in (None, model_name):
        raise RequestError(404, f"model {body['model']!r} is not served here; use {model_name!r}", "model_not_found", "model")
    if body.get("n", 1) not in (1, None):
        raise RequestError(400, "only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    given = max_tokens is not None
    if not given:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(400, f"'max_tokens' must be an integer in [1, {max_tokens_limit}]", param="max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "'seed' must be an integer", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", param="stream_options")
    return ChatRequest(
        messages=_messages(body.get("messages")), max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed, stream=stream, include_usage=bool(options.get("include_usage", False)), max_tokens_given=given,
    )


@dataclass
class Job:
    """One queued generation. The worker reports through `events`: ("tokens", ids)*, then ("done", out) or ("error", msg)."""

    prompt_ids: list[int]
    request: ChatRequest
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False

    def batch_key(self) -> tuple | None:
        """Jobs with equal keys may share one batched generate (greedy, or the same seeded sampling)."""
        r = self.request
        return None if r.stream else (r.max_tokens, r.temperature, r.top_p, r.seed if r.temperature > 0 else None)


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


class ChatServer:
    """The served engine: one worker thread draining a bounded queue, an HTTP thread per connection."""

    def __init__(self, engine: GenerationEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str = "", queue_size: int = 64, max_batch_size: int = 8, default_max_tokens: int = 512,
                 max_tokens_limit: int = 4096):
        if queue_size < 1 or max_batch_size < 1:
            raise EaglekitError("queue_size and max_batch_size must be >= 1")
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens, self.max_tokens_limit, self.max_batch_size = default_max_tokens, max_tokens_limit, max_batch_size
        self.capped_warned = False  # the default max_tokens was cut to the context left (warned once)
        self.jobs, self.metrics, self.created = JobQueue(queue_size), Metrics(), int(time.time())
        try:
            self.httpd = ThreadingHTTPServer((host, port), _Handler)
        except OSError as error:
            raise EaglekitError(f"cannot listen on {host}:{port} ({error}); pick another port=") from None
        self.httpd.daemon_threads = True
        self.httpd.app = self  # type: ignore[attr-defined]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ChatServer":
        """Serve in background threads (tests, notebooks); `shutdown()` stops them."""
        self._threads = [threading.Thread(target=self._work, name="eaglekit-engine", daemon=True),
                         threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="eaglekit-http", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl-C."""
        worker = threading.Thread(target=self._work, name="eaglekit-engine", daemon=True)
        worker.start()
        try:
            self.httpd.serve_forever()
        finally:
            self._stop.set()
            self.httpd.server_close()

    def shutdown(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

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

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while not self._stop.is_set():
            jobs = [j for j in self.jobs.take(self.max_batch_size) if not j.cancelled]
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        r, start = jobs[0].request, time.perf_counter()
        try:
            if len(jobs) > 1:
                outputs = self.engine.generate_many([j.prompt_ids for j in jobs], r.max_tokens, r.temperature, r.top_p, r.seed)  # type: ignore[attr-defined]
            else:
                job = jobs[0]
                outputs = [self.engine.generate(job.prompt_ids, r.max_tokens, r.temperature, r.top_p, r.seed,
                                                on_tokens=self._streamer(job) if r.stream else None)]
        except GenerationCancelled:
            self.metrics.add(cancelled=1)
            return
        except Exception as error:  # noqa: BLE001 - an engine failure answers 500 and the server keeps serving
            log.exception("generation failed")
            self.metrics.add(failed=len(jobs))
            for job in jobs:
                job.events.put(("error", f"{type(error).__name__}: {error}"))
            return
        self.metrics.add(generate_seconds=time.perf_counter() - start, completed=len(jobs),
                         prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
                         completion_tokens=sum(len(o.ids) for o in outputs))
        for job, out in zip(jobs, outputs):
            job.events.put(("done", out))

    @staticmethod
    def _streamer(job: Job):
        def on_tokens(ids: list[int]) -> None:
            if job.cancelled:
                raise GenerationCancelled()
            job.events.put(("tokens", ids))
        return on_tokens

    def model_card(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "eaglekit"}]}


def _error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_busy"}.get(status, "invalid_request_error")
    if status >= 500 and status != 503:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "eaglekit"

    @property
    def app(self) -> ChatServer:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # route the access log to logging
        log.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _fail(self, error: RequestError) -> None:
        self._send_json(error.status, _error_body(error.status, str(error), error.code, error.param))

    def _authorized(self) -> bool:
        key = self.app.api_key
        if not key or self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._fail(RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"))
        return False

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's naming
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            return self._send_json(200, {"status": "ok"})
        if not self._authorized():
            return None
        if path == "/v1/models":
            return self._send_json(200, self.app.model_card())
        if path == "/metrics":
            return self._send_json(200, self.app.metrics_snapshot())
        return self._fail(RequestError(404, f"no route GET {path}", "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        if path != "/v1/chat/completions":
            self.close_connection = True  # the body was not read
            return self._fail(RequestError(404, f"no route POST {path}", "not_found"))
        try:
            body = self._read_json()
            if not self._authorized():
                return None
            app = self.app
            request = parse_chat_request(body, app.model_name, app.default_max_tokens, app.max_tokens_limit)
            prompt_ids = self._encode(request)
        except RequestError as error:
            self.app.metrics.add(bad_requests=1)
            return self._fail(error)
        job = Job(prompt_ids, request)
        if not app.jobs.put(job):
            app.metrics.add(rejected_busy=1)
            return self._fail(RequestError(503, "the request queue is full; retry later", "server_busy"))
        app.metrics.add(requests=1)
        return self._stream(job) if request.stream else self._respond(job)

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError(411, "a Content-Length header is required", "length_required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the body is not valid JSON: {error}", "invalid_json") from None

    def _encode(self, request: ChatRequest) -> list[int]:
        try:
            prompt_ids = self.app.engine.encode_chat(request.messages)
        except Exception as error:  # noqa: BLE001 - chat templates raise anything (jinja TemplateError, ValueError)
            raise RequestError(400, f"the chat template rejected these messages: {error}", "invalid_messages", "messages") from None
        limit = self.app.engine.max_context
        left = None if limit is None else limit - len(prompt_ids)
        if left is not None and not request.max_tokens_given and 0 < left < request.max_tokens:
            request.max_tokens = left  # no max_tokens asked for: what the context leaves
            if not self.app.capped_warned:
                self.app.capped_warned = True
                log.warning("a request without max_tokens got %d new tokens at most, not the default %d: its prompt of %d "
                            "tokens leaves no more of the model's %d-token context (logged once)", request.max_tokens,
                            self.app.default_max_tokens, len(prompt_ids), limit)
        if limit is not None and len(prompt_ids) + request.max_tokens > limit:
            raise RequestError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                                    f"the model's context of {limit} tokens", "context_length_exceeded", "messages")
        return prompt_ids

    def _completion_id(self) -> str:
        return "chatcmpl-" + uuid.uuid4().hex[:24]

    def _usage(self, job: Job, out: EngineOutput) -> dict[str, Any]:
        usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(out.ids),
                 "total_tokens": len(job.prompt_ids) + len(out.ids)}
        return {**usage, **out.stats}

    def _respond(self, job: Job) -> None:
        while True:
            kind, value = job.events.get()
            if kind == "done":
                break
            if kind == "error":
                return self._send_json(500, _error_body(500, value, "generation_failed"))
        text = self.app.engine.decode(value.ids)
        return self._send_json(200, {
            "id": self._completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": self.app.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": value.finish_reason}],
            "usage": self._usage(job, value),
        })

    def _stream(self, job: Job) -> None:
        self.close_connection = True  # no Content-Length: the stream ends when the connection closes
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        base = {"id": self._completion_id(), "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.app.model_name}
        ids: list[int] = []
        sent = ""
        try:
            self._sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            while True:
                kind, value = job.events.get()
                if kind == "error":
                    self._sse({"error": _error_body(500, value, "generation_failed")["error"]})
                    break
                final = kind == "done"
                ids = value.ids if final else ids + value
                text = self.app.engine.decode(ids)
                if not final and text.endswith("\ufffd"):
                    continue  # an incomplete multi-byte character: wait for the next token
                delta, sent = (text[len(sent):], text) if text.startswith(sent) else ("", sent)
                if delta:
                    self._sse({**base, "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]})
                if final:
                    self._sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": value.finish_reason}]})
                    if job.request.include_usage:
                        self._sse({**base, "choices": [], "usage": self._usage(job, value)})
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True  # the worker stops this generation at its next token
            log.info("client went away during a stream; generation cancelled")

    def _sse(self, data: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()
