"""The HTTP side of `eaglekit serve` (FastAPI): the pydantic models of a chat completion request, OpenAI-shaped
errors, the JSON and SSE answers, and the routes over a `ChatServer` (`eaglekit.generation.server`).

Imported when a server is built, not by `eaglekit serve --help`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from pydantic import Strict as StrictMode
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglekit.generation.backends import EngineOutput
from eaglekit.generation.server_jobs import ChatRequest, Job, RequestError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20


# ----------------------------------------------------------------------------- request models

class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[TextPart]  # OpenAI content parts: text ones only


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionBody(BaseModel):
    """What `/v1/chat/completions` accepts (other OpenAI fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Annotated[float, StrictMode(), Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, StrictMode(), Field(gt=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None


def _validation_error(error: ValidationError) -> RequestError:
    """The first problem pydantic found, as `'messages[0].role': Input should be ...` naming the field."""
    first = error.errors()[0]
    path = ""
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list"):  # union members: no field
            path += f".{part}" if path else part
    param = str(first["loc"][0]) if first["loc"] else None
    return RequestError(400, f"'{path}': {first['msg']}" if path else first["msg"], param=param)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def parse_chat_request(body: Any, model_name: str, default_max_tokens: int, max_tokens_limit: int) -> ChatRequest:
    """Validate a `/v1/chat/completions` body (a parsed JSON value); RequestError names the offending field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        parsed = ChatCompletionBody.model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None
    if parsed.model not in (None, model_name):
        raise RequestError(404, f"model {parsed.model!r} is not served here; use {model_name!r}", "model_not_found",
                           "model")
    if parsed.n not in (1, None):
        raise RequestError(400, "only n=1 is supported", param="n")
    max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_tokens
    given = max_tokens is not None
    max_tokens = max_tokens if given else default_max_tokens
    if not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(400, f"'max_tokens' must be an integer in [1, {max_tokens_limit}]", param="max_tokens")
    messages = [{"role": m.role, "content": _text(m.content)} for m in parsed.messages]
    return ChatRequest(messages, max_tokens, 1.0 if parsed.temperature is None else parsed.temperature,
                       1.0 if parsed.top_p is None else parsed.top_p, parsed.seed, parsed.stream,
                       bool(parsed.stream_options and parsed.stream_options.include_usage), given)


def _error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kinds = {401: "authentication_error", 404: "not_found_error", 503: "server_busy"}
    kind = kinds.get(status, "invalid_request_error")
    if status >= 500 and status != 503:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def _json(status: int, data: dict[str, Any]) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json")


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


# ----------------------------------------------------------------------------- answers

def _usage(job: Job, out: EngineOutput) -> dict[str, Any]:
    usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(out.ids),
             "total_tokens": len(job.prompt_ids) + len(out.ids)}
    return {**usage, **out.stats}


async def respond(server: Any, job: Job) -> Response:
    """The JSON answer of a non-streaming completion, once the worker has finished its job."""
    kind, value = await job.next_event()
    while kind == "tokens":
        kind, value = await job.next_event()
    if kind == "error":
        return _json(500, _error_body(500, value, "generation_failed"))
    return _json(200, {
        "id": _completion_id(), "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": server.engine.decode(value.ids)},
                     "finish_reason": value.finish_reason}],
        "usage": _usage(job, value),
    })

async def stream(server: Any, job: Job) -> AsyncIterator[bytes]:
    """The SSE chunks of one streamed completion; leaving early (the client went away) cancels the job."""
    base = {"id": _completion_id(), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": server.model_name}
    text, finished = server.engine.text_stream(), False
    try:
        yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        while True:
            kind, value = await job.next_event()
            if kind == "error":
                yield _sse({"error": _error_body(500, value, "generation_failed")["error"]})
                break
            final = kind == "done"
            delta = text.finish(value.ids) if final else text.step(value)
            if delta:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]})
            if final:
                yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": value.finish_reason}]})
                if job.request.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(job, value)})
                break
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            job.cancelled = True  # the worker stops this generation at its next token
            log.info("client went away during a stream; generation cancelled")


# ----------------------------------------------------------------------------- routes

async def _read_body(request: Request) -> Any:
    """The JSON body, read up to MAX_BODY_BYTES (413 beyond)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
    try:
        return json.loads(bytes(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"the body is not valid JSON: {error}", "invalid_json") from None


class _StripTrailingSlash:
    """ASGI middleware: `/v1/models/` is `/v1/models` (no redirect)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and len(scope["path"]) > 1 and scope["path"].endswith("/"):
            scope = {**scope, "path": scope["path"].rstrip("/")}
        await self.app(scope, receive, send)


def build_app(server: Any) -> FastAPI:
    """The routes over `server` (its engine, queue, metrics and API key)."""
    app = FastAPI(title="eaglekit", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    async def authorized(request: Request) -> None:
        if server.api_key and request.headers.get("authorization", "") != f"Bearer {server.api_key}":
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key")

    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> Response:
        return _json(error.status, _error_body(error.status, str(error), error.code, error.param))

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code in (404, 405):
            message = f"no route {request.method} {request.url.path.rstrip('/')}"
            return _json(404, _error_body(404, message, "not_found"))
        return _json(error.status_code, _error_body(error.status_code, str(error.detail), "http_error"))

    app.add_middleware(_StripTrailingSlash)

    @app.get("/health")
    async def health() -> Response:
        return _json(200, {"status": "ok"})

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> Response:
        return _json(200, server.model_card())

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> Response:
        return _json(200, server.metrics_snapshot())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        try:
            body = await _read_body(request)
            chat = parse_chat_request(body, server.model_name, server.default_max_tokens, server.max_tokens_limit)
            prompt_ids = server.prompt_ids(chat)
        except RequestError:
            server.metrics.add(bad_requests=1)
            raise
        job = Job(prompt_ids, chat, loop=asyncio.get_running_loop())
        if not server.jobs.put(job):
            server.metrics.add(rejected_busy=1)
            raise RequestError(503, "the request queue is full; retry later", "server_busy")
        server.metrics.add(requests=1)
        if chat.stream:
            return StreamingResponse(stream(server, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await respond(server, job)

    return app
