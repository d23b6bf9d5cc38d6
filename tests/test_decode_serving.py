"""`eaglekit serve drafter=DIR`: the speculative engine answers like the target's greedy decoding and
reports acceptance statistics on /metrics."""

from __future__ import annotations

import httpx
import torch

from eaglekit.draft.model import DrafterConfig, Eagle3Drafter
from eaglekit.stages import serve
from eaglekit.target.backends import HFBackend

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
    assert answer["choices"][0]["message"]["content"] == reference.decode(expected.ids)
    assert answer["choices"][0]["finish_reason"] == expected.finish_reason
    assert metrics["engine"]["engine"] == "eaglekit-speculative" and metrics["engine"]["requests"] == 1
    assert metrics["engine"]["tau"] >= 1.0 and len(metrics["engine"]["acceptance_per_position"]) == 6
