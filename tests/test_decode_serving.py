"""`eaglekit serve drafter=DIR`: the speculative engine answers like the target's greedy decoding and
reports acceptance statistics on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.stages import serve
from eaglekit.generation.backends import HFBackend

MESSAGES = [{"role": "user", "content": "what is two plus two"}]


def test_serve_with_drafter_matches_target_and_reports_acceptance(chat_target, tmp_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(chat_target).vocab_size
    torch.manual_seed(4)
    drafter = Eagle3Drafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=32, aux_layer_ids=(2, 2, 1)))
    drafter.set_vocab_mapping(torch.arange(vocab))
    drafter.save_pretrained(tmp_path / "drafter", include_embedding=False)
    config = serve.Config(target=chat_target, port=0, drafter=str(tmp_path / "drafter"), device="cpu", dtype="fp32", max_tokens=8)
    engine = serve.build_engine(config)
    reference = HFBackend.load(chat_target, "cpu", "fp32")
    expected = reference.generate(reference.encode_chat(MESSAGES), 8)
    with serve.build_server(config, engine=engine) as running, httpx.Client(timeout=60) as client:
        answer = client.post(running.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0}).json()
        metrics = client.get(running.url + "/metrics").json()
        with client.stream("POST", running.url + "/v1/chat/completions",
                           json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert answer["choices"][0]["message"]["content"] == reference.decode(expected.ids)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == answer["choices"][0]["message"]["content"]  # the speculative steps' tokens, streamed
    assert answer["choices"][0]["finish_reason"] == expected.finish_reason
    assert metrics["engine"]["engine"] == "eaglekit-speculative" and metrics["engine"]["requests"] == 1
    engine_stats, usage = metrics["engine"], answer["usage"]
    assert usage["tau"] == engine_stats["tau"]  # one request: its own figures are the engine's totals
    assert usage["acceptance_per_position"] == engine_stats["acceptance_per_position"]
    rates, steps = engine_stats["acceptance_per_position"], engine_stats["verify_steps"]
    assert len(rates) == 6 and all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:]))  # the default tree depth
    assert engine_stats["tau"] == pytest.approx(1 + sum(rates))  # mean accepted drafts == sum of P(draft i accepted)
    # the prefill gives the first token, each verify step its accepted drafts and a bonus token (the last step
    # may overshoot max_tokens, or stop at EOS, by at most the depth)
    produced = 1 + round(engine_stats["tau"] * steps)
    completion = usage["completion_tokens"] + (expected.finish_reason == "stop")  # the EOS token is not returned
    assert steps >= 1 and completion <= produced <= completion + 6
