"""`eaglekit regen`: turn planning, hf backend (golden against direct generation), resume after a crash,
the openai backend against a real `eaglekit serve` on loopback, and a misbehaving server (retries, failures)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eaglekit.errors import EaglekitError
from eaglekit.stages import regen, serve
from eaglekit.generation.regen import Progress, plan_turns, scan_finished
from eaglekit.generation.backends import HFBackend, OpenAIBackend, SamplingParams

RECORDS = [
    {"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                             {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "the lazy dog"},
                             {"role": "assistant", "content": "OLD"}]},
    {"id": "b", "messages": [{"role": "user", "content": "what is two plus two"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "quick brown fox"}, {"from": "gpt", "value": "OLD"}]},
    {"id": "d", "prompt": "jumps over"},
    {"id": "e", "messages": [{"role": "system", "content": "only a system turn"}]},
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


@pytest.fixture(scope="module")
def backend(chat_target):
    return HFBackend.load(chat_target, "cpu", "fp32")


def _records(directory) -> dict[str, dict]:
    lines = (directory / "conversations.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def _hf(prompts, target, output, **options) -> regen.RegenResult:
    return regen.run(regen.Config(data=(prompts,), output=str(output), target=target, max_new_tokens=6,
                                  batch_size=2, device="cpu", **options))


def test_plan_turns_rules():
    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    assert plan_turns([s, u, a, u, a]) == [s, u, None, u, None]
    assert plan_turns([s, u, a, u, a], "first") == [s, u, None]
    assert plan_turns([u, u, a, u]) == [u, u, None, u, None]  # consecutive user turns share one answer
    assert plan_turns([a, u]) == [u, None]  # an assistant turn with no user before it is dropped
    assert plan_turns([s]) == [s]  # nothing to answer
    assert plan_turns([u, a, a]) == [u, None]


def test_hf_regen_equals_direct_generation_with_regenerated_history(prompts, chat_target, backend, tmp_path):
    result = _hf(prompts, chat_target, tmp_path / "out")
    records = _records(tmp_path / "out")
    assert sorted(records) == ["a", "b", "c", "d"]  # "e" has no user turn
    params = SamplingParams(0.0, 1.0, 6)
    # multi-turn: the second answer is generated from the history holding the REGENERATED first answer
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    first = backend.generate_batch([history], params)[0]
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "the lazy dog"}]
    second = backend.generate_batch([history], params)[0]
    assert records["a"]["messages"] == history + [{"role": "assistant", "content": second.text}]
    assert records["a"]["regen"]["completion_tokens"] == [first.completion_tokens, second.completion_tokens]
    solo = backend.generate_batch([[{"role": "user", "content": "quick brown fox"}]], params)[0]
    assert records["c"]["messages"][-1]["content"] == solo.text
    assert records["d"]["messages"][0] == {"role": "user", "content": "jumps over"}
    assert records["b"]["regen"]["model"] == chat_target and records["b"]["regen"]["temperature"] == 0.0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["generated"] == 4 and stats["answers"] == 5 and stats["failed"] == 0 and stats["skipped_no_user_turn"] == 1
    assert stats["completion_tokens"] == sum(sum(r["regen"]["completion_tokens"]) for r in records.values())
    assert result.stats == stats and (tmp_path / "out" / "manifest.json").is_file()
    assert (tmp_path / "out" / "config.yaml").is_file()
    # the output is itself valid input data for the next stages (ids kept)
    from eaglekit.data import read_conversations
    assert {c.id for c in read_conversations(str(tmp_path / "out" / "conversations.jsonl"))} == set(records)


def test_turns_first_and_limit(prompts, chat_target, tmp_path):
    _hf(prompts, chat_target, tmp_path / "out", turns="first", limit=2)
    records = _records(tmp_path / "out")
    assert sorted(records) == ["a", "b"]
    assert [m["role"] for m in records["a"]["messages"]] == ["system", "user", "assistant"]


def test_resume_after_crash_skips_finished_and_matches_uninterrupted(prompts, chat_target, tmp_path, monkeypatch):
    _hf(prompts, chat_target, tmp_path / "reference")
    reference = _records(tmp_path / "reference")

    finish = Progress.finish
    def crash_after_two(self, pending):  # simulate Ctrl-C after two records were written
        if self.counts["generated"] == 2:
            raise KeyboardInterrupt
        finish(self, pending)
    monkeypatch.setattr(Progress, "finish", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        _hf(prompts, chat_target, tmp_path / "out")
    monkeypatch.setattr(Progress, "finish", finish)
    output = tmp_path / "out" / "conversations.jsonl"
    assert len(scan_finished(output)) == 2 and not (tmp_path / "out" / "manifest.json").exists()
    with open(output, "a") as handle:  # and a half-written line, as a killed process leaves
        handle.write('{"id": "zz", "messages": [{"role": "us')
    result = _hf(prompts, chat_target, tmp_path / "out")
    assert result.stats["generated"] == 2  # only the two missing records
    assert _records(tmp_path / "out") == reference
    assert _hf(prompts, chat_target, tmp_path / "out").stats["generated"] == 0  # a third run has nothing to do


def test_seeded_sampling_is_reproducible(prompts, chat_target, tmp_path):
    sample = {"temperature": 1.0, "top_p": 0.9, "limit": 2}
    _hf(prompts, chat_target, tmp_path / "one", seed=5, **sample)
    _hf(prompts, chat_target, tmp_path / "two", seed=5, **sample)
    _hf(prompts, chat_target, tmp_path / "three", seed=6, **sample)
    one, two, three = (_records(tmp_path / d) for d in ("one", "two", "three"))
    assert one == two
    assert [r["messages"] for r in one.values()] != [r["messages"] for r in three.values()]


def test_damaged_line_inside_the_output_is_an_error(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(EaglekitError, match="line 2"):
        scan_finished(path)
    path.write_text('{"id": "a"}\n{"id": "b"')
    assert scan_finished(path) == {"a"} and path.read_text() == '{"id": "a"}\n'


def test_resume_with_other_settings_is_refused(prompts, chat_target, tmp_path):
    _hf(prompts, chat_target, tmp_path / "out", limit=1)
    with pytest.raises(EaglekitError, match="temperature"):
        _hf(prompts, chat_target, tmp_path / "out", temperature=0.7)


def test_bad_options_name_the_fix(prompts, tmp_path):
    with pytest.raises(EaglekitError, match="target="):
        regen.run(regen.Config(data=(prompts,), output=str(tmp_path)))
    with pytest.raises(EaglekitError, match="servers="):
        regen.run(regen.Config(data=(prompts,), output=str(tmp_path), backend="openai"))
    with pytest.raises(EaglekitError, match="start the server"):
        regen.run(regen.Config(data=(prompts,), output=str(tmp_path / "x"), backend="openai",
                               servers=("http://127.0.0.1:9",), retries=0, timeout=5))


def test_openai_backend_against_real_serve_equals_hf(prompts, chat_target, backend, tmp_path):
    _hf(prompts, chat_target, tmp_path / "hf")
    config = serve.Config(target=chat_target, port=0, api_key="k")
    with serve.build_server(config, engine=backend) as server:
        with pytest.raises(EaglekitError, match="api_key"):
            regen.run(regen.Config(data=(prompts,), output=str(tmp_path / "bad"), backend="openai",
                                   servers=(server.url,), api_key="wrong", max_new_tokens=6))
        regen.run(regen.Config(data=(prompts,), output=str(tmp_path / "api"), backend="openai", servers=(server.url,),
                               api_key="k", max_new_tokens=6, concurrency=3))
        served = server.metrics_snapshot()
        client = OpenAIBackend([server.url + "/v1"], api_key="k", concurrency=2)
        batch = [[{"role": "user", "content": "what is two plus two"}], [{"role": "user", "content": "jumps over"}]]
        via_client = client.generate_batch(batch, SamplingParams(0.0, 1.0, 6))
        client.close()
    assert [(g.text, g.completion_tokens) for g in via_client] == \
           [(g.text, g.completion_tokens) for g in backend.generate_batch(batch, SamplingParams(0.0, 1.0, 6))]
    via_server, direct = _records(tmp_path / "api"), _records(tmp_path / "hf")
    assert {k: r["messages"] for k, r in via_server.items()} == {k: r["messages"] for k, r in direct.items()}
    assert {k: r["regen"]["completion_tokens"] for k, r in via_server.items()} == \
           {k: r["regen"]["completion_tokens"] for k, r in direct.items()}
    assert served["completed"] == 5  # one request per answer
    # round-robin over a dead URL and a live one: each failed attempt moves to the next URL
    with serve.build_server(config, engine=backend) as server:
        regen.run(regen.Config(data=(prompts,), output=str(tmp_path / "rr"), backend="openai", api_key="k",
                               servers=("http://127.0.0.1:9", server.url), max_new_tokens=6, concurrency=1,
                               retries=1, backoff=0.01, limit=2))
    assert {k: r["messages"] for k, r in _records(tmp_path / "rr").items()} == \
           {k: direct[k]["messages"] for k in ("a", "b")}
    saved = (tmp_path / "api" / "config.yaml").read_text()
    assert "api_key: <redacted>" in saved and "api_key: k\n" not in saved


class FlakyHandler(BaseHTTPRequestHandler):
    """Per prompt: 500, then garbage, then a good answer (with reasoning); prompts holding 'dog' always 500."""

    attempts: dict[str, int] = {}
    broken = True
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, status, payload: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "flaky"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        with self.lock:
            self.attempts[prompt] = attempt = self.attempts.get(prompt, 0) + 1
        if ("dog" in prompt and type(self).broken) or attempt == 1:
            return self._send(500, b"internal error")
        if attempt == 2:
            return self._send(200, b"<html>not json")
        answer = {"choices": [{"message": {"role": "assistant", "content": f"ANSWER {prompt}", "reasoning_content": "hmm"},
                               "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        self._send(200, json.dumps(answer).encode())


def test_flaky_server_retries_marks_failures_and_rerun_recovers(prompts, tmp_path):
    FlakyHandler.attempts, FlakyHandler.broken = {}, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    config = regen.Config(data=(prompts,), output=str(tmp_path / "out"), backend="openai", servers=(url,),
                          retries=3, backoff=0.01, concurrency=2)
    try:
        with pytest.raises(EaglekitError, match="1 record"):
            regen.run(config)
        failures = [json.loads(l) for l in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
        assert [f["id"] for f in failures] == ["a"] and "HTTP 500" in failures[0]["error"]
        records = _records(tmp_path / "out")
        assert sorted(records) == ["b", "c", "d"]
        assert records["b"]["messages"][-1] == {"role": "assistant", "content": "ANSWER what is two plus two",
                                                "reasoning_content": "hmm"}
        assert FlakyHandler.attempts["the lazy dog"] == 4  # 1 try + 3 retries
        FlakyHandler.broken = False
        result = regen.run(config)  # the failed record is retried, nothing else
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert result.stats["generated"] == 1 and result.stats["outstanding_failures"] == 0
    assert (tmp_path / "out" / "failures.jsonl").read_text() == ""
    assert _records(tmp_path / "out")["a"]["messages"][-1]["content"] == "ANSWER the lazy dog"
    assert (tmp_path / "out" / "manifest.json").is_file()
