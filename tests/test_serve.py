"""`eaglekit serve`: OpenAI-compatible routes, errors, streaming, API key, bounded queue, batching, metrics.

Every server listens on 127.0.0.1 on a free port chosen by the OS; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

import httpx
import pytest

from eaglekit.stages import serve
from eaglekit.generation.backends import EngineOutput, HFBackend, SamplingParams
from eaglekit.generation.server import ChatServer, parse_chat_request, RequestError
from eaglekit.generation.server_text import TextStream

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"}]


@pytest.fixture(scope="module")
def backend(chat_target) -> HFBackend:
    return HFBackend.load(chat_target, "cpu", "fp32")


@pytest.fixture
def server(chat_target, backend):
    config = serve.Config(target=chat_target, port=0, api_key="sekret", model_name="tiny-chat", max_tokens=6)
    with serve.build_server(config, engine=backend) as running:
        yield running


def _client(key: str | None = "sekret") -> httpx.Client:
    return httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_models_and_api_key(server):
    with _client() as client:
        card = client.get(server.url + "/v1/models").json()
    assert [m["id"] for m in card["data"]] == ["tiny-chat"]
    with _client(None) as client:
        assert client.get(server.url + "/health").status_code == 200  # health needs no key
        missing = client.get(server.url + "/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    with _client("wrong") as client:
        assert client.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES}).status_code == 401


def test_completion_equals_target_greedy(server, backend):
    with _client() as client:
        answer = client.post(server.url + "/v1/chat/completions",
                             json={"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 7, "temperature": 0}).json()
    expected = backend.generate_batch([MESSAGES], SamplingParams(0.0, 1.0, 7))[0]
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == expected.finish_reason
    assert answer["usage"] == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": expected.completion_tokens,
                               "total_tokens": expected.prompt_tokens + expected.completion_tokens}
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny-chat"


def _sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_streaming_matches_non_streaming(server):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    with _client() as client:
        whole = client.post(server.url + "/v1/chat/completions", json=body).json()
        with client.stream("POST", server.url + "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{}", 400, "'messages'"),
    (json.dumps({"messages": "hi"}).encode(), 400, "'messages'"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "content"),
    (json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"messages": MESSAGES, "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"messages": MESSAGES, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": MESSAGES, "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"messages": MESSAGES, "n": 2}).encode(), 400, "n=1"),
    (json.dumps({"messages": MESSAGES, "model": "gpt-9"}).encode(), 404, "tiny-chat"),
    (json.dumps({"messages": MESSAGES, "max_tokens": 600}).encode(), 400, "context"),
])
def test_malformed_requests_get_clear_4xx(server, body, status, fragment):
    with _client() as client:
        response = client.post(server.url + "/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    with _client() as client:  # the server still answers afterwards
        assert client.get(server.url + "/v1/models").status_code == 200


def test_unknown_route_is_404(server):
    with _client() as client:
        assert client.get(server.url + "/v2/nothing").status_code == 404
        assert client.post(server.url + "/v1/completions", json={}).status_code == 404
        wrong_method = client.get(server.url + "/v1/chat/completions")
        assert wrong_method.status_code == 404 and wrong_method.json()["error"]["code"] == "not_found"
        assert client.get(server.url + "/v1/models/").status_code == 200  # a trailing slash names the same route


def test_oversized_body_is_413(server, monkeypatch):
    from eaglekit.generation import server_api

    monkeypatch.setattr(server_api, "MAX_BODY_BYTES", 64)
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    assert len(body) > 64
    with _client() as client:
        sized = client.post(server.url + "/v1/chat/completions", content=body)
        chunked = client.post(server.url + "/v1/chat/completions", content=iter([body[:40], body[40:]]))
    assert sized.status_code == 413 and sized.json()["error"]["code"] == "body_too_large"
    assert chunked.status_code == 413  # no Content-Length: counted while read


def test_parse_chat_request_defaults_and_content_parts():
    request = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}]},
                                 "m", default_max_tokens=5, max_tokens_limit=10)
    assert request.messages == [{"role": "user", "content": "ab"}]
    assert (request.max_tokens, request.temperature, request.top_p, request.stream) == (5, 1.0, 1.0, False)
    with pytest.raises(RequestError):
        parse_chat_request({"messages": MESSAGES, "seed": 1.5}, "m", 5, 10)


class GatedEngine:
    """A fake engine: blocks until `gate` is set, records calls, reports stats like a drafter would."""

    max_context = None

    def __init__(self):
        self.gate, self.calls = threading.Event(), []

    def encode_chat(self, messages):
        return [len(m["content"]) for m in messages]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def text_stream(self):
        return TextStream(self)

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, on_tokens=None):
        self.calls.append(("one", 1))
        assert self.gate.wait(20)
        return EngineOutput([7] * max_new_tokens, "length", {"acceptance_length": 2.5})

    def generate_many(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=None):
        self.calls.append(("many", len(prompts)))
        return [EngineOutput([7] * max_new_tokens, "length", {"acceptance_length": 2.5}) for _ in prompts]

    def metrics(self):
        return {"engine": "gated", "drafted": 11}


def test_queue_full_is_503_then_queued_requests_batch():
    engine = GatedEngine()
    with ChatServer(engine, "fake", port=0, queue_size=2, max_batch_size=4) as server:
        url = server.url + "/v1/chat/completions"
        body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=30))) for _ in range(3)]
        threads[0].start()
        deadline = time.time() + 10
        while not engine.calls and time.time() < deadline:  # the first request is generating (blocked)
            time.sleep(0.01)
        for thread in threads[1:]:
            thread.start()
        while len(server.jobs) < 2 and time.time() < deadline:  # two more wait in the queue: it is full
            time.sleep(0.01)
        busy = httpx.post(url, json=body, timeout=30)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        engine.gate.set()
        for thread in threads:
            thread.join(timeout=20)
        assert [r.status_code for r in results] == [200, 200, 200]
        assert engine.calls == [("one", 1), ("many", 2)]  # the queued pair ran as one batch
        usage = results[0].json()["usage"]
        assert usage["acceptance_length"] == 2.5 and usage["completion_tokens"] == 3
        metrics = httpx.get(server.url + "/metrics", timeout=30).json()
    assert metrics["completed"] == 3 and metrics["rejected_busy"] == 1 and metrics["completion_tokens"] == 9
    assert metrics["engine"] == {"engine": "gated", "drafted": 11}


def test_cli_serve_subprocess(chat_target):
    """The real command: `python -m eaglekit serve DIR port=0` prints its URL and answers."""
    env = {**os.environ, "EAGLEKIT_API_KEY": "k2"}
    process = subprocess.Popen([sys.executable, "-m", "eaglekit", "serve", chat_target, "port=0", "device=cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 90)
        line = process.stdout.readline() if ready else ""  # the banner, or EOF if the process died
        assert " on http://127.0.0.1:" in line, line
        base = line.split(" on ")[1].split()[0]
        assert httpx.get(base + "/models", timeout=30).status_code == 401
        answer = httpx.post(base + "/chat/completions", headers={"Authorization": "Bearer k2"}, timeout=60,
                            json={"messages": MESSAGES, "max_tokens": 4}).json()
        assert answer["usage"]["completion_tokens"] <= 4 and answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        process.terminate()
        process.wait(timeout=30)


class EndlessEngine(GatedEngine):
    """Streams one token every few milliseconds until the server cancels it (bounded)."""

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, on_tokens=None):
        for step in range(2000):
            on_tokens([65 + step % 26])  # raises GenerationCancelled once the client is gone
            time.sleep(0.005)
        return EngineOutput([65] * 2000, "length")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_client_leaving_a_stream_cancels_the_generation():
    with ChatServer(EndlessEngine(), "fake", port=0) as server:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", server.url + "/v1/chat/completions",
                               json={"messages": MESSAGES, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")  # role chunk
                assert json.loads(next(l for l in lines if l.startswith("data: "))[6:])["choices"][0]["delta"]["content"]
        deadline = time.time() + 10
        while server.metrics_snapshot()["cancelled"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        metrics = server.metrics_snapshot()
        assert metrics["cancelled"] == 1 and metrics["completed"] == 0
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
