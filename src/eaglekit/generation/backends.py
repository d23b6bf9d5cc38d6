"""Generation backends for `regen` and `serve`: the target in-process (`HFBackend`) or behind an
OpenAI-compatible `/v1/chat/completions` server (`OpenAIBackend`: vLLM, SGLang, `eaglekit serve`).

Both answer `generate_batch(list of message lists, SamplingParams) -> list[Generation]`.
`HFBackend` also implements the token-level engine interface that `eaglekit.generation.server` serves
(`generate(prompt_ids, max_new_tokens, temperature, top_p, seed, on_tokens) -> EngineOutput`).

Failure policy of `OpenAIBackend`: connection errors, timeouts, 5xx, 429 and unreadable answers are
retried with exponential backoff on the next server URL; other 4xx fail that request only
(`BackendError`); 401/403/404 mean every request will fail, so they raise `EaglekitError` at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import httpx

from eaglekit.errors import EaglekitError

if TYPE_CHECKING:  # torch is imported where a generation runs, so `regen`/`serve --help` stay fast
    import torch

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]  # OpenAI messages: [{"role": ..., "content": ...}, ...]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 = greedy (seed unused); top_p 1 = no nucleus cut."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None


@dataclass
class Generation:
    """One assistant answer with its token counts. `finish_reason` is "stop" (eos) or "length"."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    reasoning: str | None = None


@dataclass
class EngineOutput:
    """Token-level result of one generation; `stats` are engine-specific (e.g. drafter acceptance)."""

    ids: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class BackendError(Exception):
    """One request failed for good (after retries, or a 4xx the server will repeat); the record is marked failed.
    `retryable` is False when running the same request again must fail the same way (a prompt too long)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class GenerationCancelled(Exception):
    """Raised by an `on_tokens` callback to stop a generation early (e.g. the HTTP client went away)."""


# ----------------------------------------------------------------------------- in-process target


class _TokenStreamer:
    """A `generate(streamer=...)` receiver that forwards new token ids (batch size 1) to a callback."""

    def __init__(self, on_tokens: Callable[[list[int]], None]):
        self.on_tokens = on_tokens
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first pushes the prompt itself
            self.prompt_seen = True
            return
        self.on_tokens(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise EaglekitError("the target has no eos token (neither generation_config nor tokenizer sets one); "
                            "set eos_token in the tokenizer config")
    return ids


class HFBackend:
    """The target in this process: chat template, batched LEFT-padded `model.generate`, stop at eos."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str = "target"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise EaglekitError(f"the tokenizer of {name} has no chat template; pass chat_template=FILE.jinja (or a "
                                "Jinja string), or use an instruct/chat model")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to call from several threads
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.device = next(model.parameters()).device
        self.max_context = getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                                   "max_position_embeddings", None)
        self.capped_answers = 0  # answers whose max_new_tokens was cut to the context their prompt leaves

    @classmethod
    def load(cls, target: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False,
             chat_template: str = "") -> "HFBackend":
        """The target and its tokenizer; `chat_template` (Jinja text or file) replaces the tokenizer's own."""
        from eaglekit.data.tokenize import resolve_chat_template
        from eaglekit.runtime import resolve_device, resolve_dtype
        from eaglekit.targets.loading import load_target, load_tokenizer

        tokenizer = load_tokenizer(target, trust_remote_code)
        if chat_template:
            tokenizer.chat_template = resolve_chat_template(tokenizer, chat_template)
        torch_device = resolve_device(device)
        model = load_target(target, torch_device, resolve_dtype(dtype, torch_device), trust_remote_code)
        return cls(model, tokenizer, name=target)

    def encode_chat(self, messages: Messages) -> list[int]:
        """Token ids of `messages` under the chat template, ending with the assistant prompt."""
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text_stream(self) -> Any:
        """A `TextStream` (eaglekit.generation.server_text): one generation's text as its tokens arrive."""
        from eaglekit.generation.server_text import TextStream

        return TextStream(self.tokenizer, self._tokenizer_lock)

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams,
                     on_tokens: Callable[[list[int]], None] | None = None) -> list[EngineOutput]:
        """Batched generation from token ids; each output is cut at its first eos."""
        import torch

        assert prompts and all(prompts), "every prompt needs at least one token"
        assert on_tokens is None or len(prompts) == 1, "streaming needs batch size 1"
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, T), left-padded
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        sample = params.temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": params.max_new_tokens,
                                  "eos_token_id": self.eos_ids, "pad_token_id": self.pad_id}
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        else:  # neutralise sampling defaults from the model's generation_config (avoids warnings)
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if on_tokens is not None:
            kwargs["streamer"] = _TokenStreamer(on_tokens)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), **kwargs)
        new = out[:, width:].tolist()  # (B, new_tokens)
        return [self._cut_at_eos(row) for row in new]

    def _cut_at_eos(self, ids: list[int]) -> EngineOutput:
        for index, token in enumerate(ids):
            if token in self.eos_ids:
                return EngineOutput(ids[:index], "stop")
        return EngineOutput(ids, "length")

    # engine interface served by eaglekit.generation.server
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, on_tokens: Callable[[list[int]], None] | None = None) -> EngineOutput:
        params = SamplingParams(temperature, top_p, max_new_tokens, seed)
        return self.generate_ids([prompt_ids], params, on_tokens)[0]

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None) -> list[EngineOutput]:
        return self.generate_ids(prompts, SamplingParams(temperature, top_p, max_new_tokens, seed))

    def metrics(self) -> dict[str, Any]:
        return {"engine": "hf"}

    def generate_batch(self, conversations: list[Messages], params: SamplingParams) -> list[Generation | BackendError]:
        """One answer per message list, each with at most the context its prompt leaves (`capped_answers` counts
        the cut ones); a prompt that fills the whole context is returned as a BackendError that no retry fixes."""
        prompts = [self.encode_chat(messages) for messages in conversations]
        limit = params.max_new_tokens
        budgets = [limit if self.max_context is None else min(limit, self.max_context - len(p)) for p in prompts]
        self.capped_answers += sum(0 < b < limit for b in budgets)
        results: dict[int, Generation | BackendError] = {}
        for budget in sorted(set(budgets)):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            if budget < 1:
                for i in rows:
                    results[i] = BackendError(f"prompt of {len(prompts[i])} tokens fills the target's context of "
                                              f"{self.max_context}: shorten or drop this record", retryable=False)
                continue
            outputs = self.generate_ids([prompts[i] for i in rows], dataclasses.replace(params, max_new_tokens=budget))
            for i, out in zip(rows, outputs):
                results[i] = Generation(self.decode(out.ids), len(prompts[i]), len(out.ids), out.finish_reason)
        return [results[i] for i in range(len(prompts))]


# ----------------------------------------------------------------------------- OpenAI-compatible server


def normalize_url(url: str) -> str:
    """'http://host:8000', '.../v1' or '.../v1/chat/completions' -> 'http://host:8000/v1'."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EaglekitError(f"server url '{url}' must start with http:// or https://, e.g. http://127.0.0.1:8000")
    for suffix in ("/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url + "/v1"


class _Retry(Exception):
    """A transient failure worth another attempt."""


class OpenAIBackend:
    """A client for one or more OpenAI-compatible servers (round-robin), thread-safe."""

    def __init__(self, urls: list[str] | tuple[str, ...], api_key: str = "", model: str = "", concurrency: int = 8,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 1.0):
        if not urls:
            raise EaglekitError("backend=openai needs servers=URL[,URL...], e.g. servers=http://127.0.0.1:8000")
        if concurrency < 1 or retries < 0 or timeout <= 0:
            raise EaglekitError("concurrency must be >= 1, retries >= 0 and timeout > 0")
        self.urls = [normalize_url(u) for u in urls]
        self.model, self.retries, self.backoff, self.concurrency = model, retries, backoff, concurrency
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                   limits=httpx.Limits(max_connections=concurrency * 2))
        self._slots = threading.BoundedSemaphore(concurrency)
        self._next_url = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop: requests in flight fail at their next attempt instead of retrying."""
        self._closed.set()
        self.client.close()

    def _url(self) -> str:
        with self._lock:
            return self.urls[next(self._next_url) % len(self.urls)]

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 parse: Callable[[dict[str, Any]], Any] = lambda data: data) -> Any:
        """One call with retries; returns `parse(decoded JSON object)` (a ValueError from parse is retried)."""
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                self._closed.wait(min(self.backoff * 2 ** (attempt - 1), 30.0))
            if self._closed.is_set():
                raise BackendError("the client was closed (run interrupted)")
            url = self._url() + path
            try:
                return self._attempt(method, url, body, parse)
            except _Retry as error:
                last = str(error)
                log.warning("%s %s failed (attempt %d/%d): %s", method, url, attempt + 1, self.retries + 1, last)
        raise BackendError(f"gave up after {self.retries + 1} attempts: {last}")

    def _attempt(self, method: str, url: str, body: dict[str, Any] | None,
                 parse: Callable[[dict[str, Any]], Any]) -> Any:
        try:
            response = self.client.request(method, url, json=body)
        except RuntimeError:  # httpx: the client was closed by another thread
            raise BackendError("the client was closed (run interrupted)") from None
        except httpx.TransportError as error:  # connection refused/reset, timeouts, broken protocol
            raise _Retry(f"{type(error).__name__}: {error}") from None
        status = response.status_code
        if status >= 500 or status == 429:
            raise _Retry(f"HTTP {status}: {response.text[:200]}")
        if status in (401, 403):
            raise EaglekitError(f"{url} refused the request (HTTP {status}); pass the server's key as api_key=...")
        if status == 404:
            raise EaglekitError(f"{url} answered 404 ({response.text[:200]}); check the server url and model=")
        if status >= 400:  # the server rejects this request as such: it will answer the same again
            raise BackendError(f"HTTP {status}: {response.text[:300]}", retryable=False)
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Retry(f"unreadable JSON answer: {response.text[:100]!r}") from None
        if not isinstance(data, dict):
            raise _Retry(f"answer is not a JSON object: {response.text[:100]!r}")
        try:
            return parse(data)
        except ValueError as error:  # well-formed JSON but not the answer asked for
            raise _Retry(f"unusable answer: {error}") from None

    def resolve_model(self) -> str:
        """The model name to send: the configured one, else the first one `GET /v1/models` lists."""
        with self._lock:
            if self.model:
                return self.model
        data = self._request("GET", "/models")
        models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]
        if not models:
            raise EaglekitError(f"{self.urls[0]}/models lists no model; pass model=NAME")
        with self._lock:
            self.model = self.model or str(models[0])
        return self.model

    def chat(self, messages: Messages, params: SamplingParams) -> Generation:
        """One chat completion (blocking; at most `concurrency` run at once)."""
        body: dict[str, Any] = {"model": self.resolve_model(), "messages": messages, "stream": False,
                                "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        with self._slots:
            return self._request("POST", "/chat/completions", body, parse_completion)

    def generate_batch(self, conversations: list[Messages], params: SamplingParams) -> list[Generation | BackendError]:
        """Concurrent chats; a request that fails for good is returned as its `BackendError`."""
        def one(messages: Messages) -> Generation | BackendError:
            try:
                return self.chat(messages, params)
            except BackendError as error:
                return error

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations) or 1)) as pool:
            return list(pool.map(one, conversations))


def parse_completion(data: dict[str, Any]) -> Generation:
    """A `/v1/chat/completions` answer -> Generation; ValueError when it is not one."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices in {str(data)[:200]}")
    message = choices[0].get("message")
    if not isinstance(message, dict) or not isinstance(message.get("content", ""), (str, type(None))):
        raise ValueError(f"no message content in {str(choices[0])[:200]}")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return Generation(
        text=message.get("content") or "",
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=str(choices[0].get("finish_reason") or "stop"),
        reasoning=reasoning if isinstance(reasoning, str) else None,
    )
