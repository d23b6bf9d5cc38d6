"""Bounded shapes and big targets in training: extra padding to a multiple of `pad_to_multiple` leaves the loss
unchanged, compiled flex attention does not recompile per length, `device_map` reaches the target loader
(online, one process) and is refused where it cannot apply."""

from __future__ import annotations

import json
import random

import pytest
import torch

from eaglekit.config import load_config
import eaglekit.training.setup as train_setup
from eaglekit.training.data import padded_length
from eaglekit.training.loop import pad_multiple, train
from eaglekit.errors import EaglekitError
from eaglekit.stages import train as stage

WORDS = "the quick brown fox jumps over the lazy dog hello world what is two plus".split()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("shapes_data") / "chat.jsonl"
    with open(path, "w") as handle:
        for i in range(12):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            handle.write(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": question},
                                                                 {"role": "assistant", "content": answer}]}) + "\n")
    return path


def options(chat_target, data_file, out, **extra):
    base = {"target": chat_target, "data": [str(data_file)], "output": str(out), "batch_size": 4, "ttt_steps": 3,
            "draft_vocab_size": 64, "val_fraction": 0.25, "lr": 1e-3, "warmup_steps": 1, "max_steps": 2, "log_every": 1,
            "device": "cpu"}
    return load_config(stage.Config, overrides={**base, **extra})


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_padded_length_and_auto_multiple():
    assert [padded_length(n, 128) for n in (1, 127, 128, 129, 512)] == [128, 128, 128, 256, 512]
    assert padded_length(37, 1) == 37
    assert pad_multiple(0, torch.device("cpu")) == 1 and pad_multiple(0, torch.device("cuda", 0)) == 128
    assert pad_multiple(64, torch.device("cpu")) == 64
    with pytest.raises(EaglekitError, match="pad_to_multiple"):
        pad_multiple(-1, torch.device("cpu"))


def test_extra_padding_leaves_loss_and_accuracy_unchanged(chat_target, data_file, tmp_path, monkeypatch):
    lengths = []
    real_batch = train_setup.OnlineSource.batch

    def batch(self, indices, device, dtype, pad_to_multiple=1):
        result = real_batch(self, indices, device, dtype, pad_to_multiple)
        lengths.append(result.input_ids.shape[1])
        return result

    monkeypatch.setattr(train_setup.OnlineSource, "batch", batch)
    train(options(chat_target, data_file, tmp_path / "plain", pad_to_multiple=1))
    plain_lengths, lengths[:] = list(lengths), []
    train(options(chat_target, data_file, tmp_path / "padded", pad_to_multiple=64))
    assert all(t % 64 == 0 for t in lengths) and any(t % 64 for t in plain_lengths)  # the padding really happened
    plain, padded = metrics(tmp_path / "plain"), metrics(tmp_path / "padded")
    assert [m["split"] for m in plain] == [m["split"] for m in padded] == ["train", "train", "val"]
    for a, b in zip(plain, padded):
        assert a["tokens"] == b["tokens"] and a["acc_k"] == b["acc_k"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["loss_k"] == pytest.approx(b["loss_k"], rel=1e-5)


def test_compiled_flex_attention_does_not_recompile_per_length():
    from torch._dynamo.testing import CompileCounterWithBackend

    from eaglekit.drafters.common import compiled_flex_attention
    from eaglekit.drafters.eagle3.ttt import ttt_block_mask

    torch._dynamo.reset()  # no compiled entries of flex_attention left by other tests count against the limit
    counter = CompileCounterWithBackend("aot_eager")
    flex = compiled_flex_attention(counter)
    for length in (128, 256, 384, 512):
        for step in range(3):  # TTT: key length (step + 1) * T
            q, kv = torch.randn(1, 2, length, 8), torch.randn(1, 1, (step + 1) * length, 8)
            flex(q, kv, kv, block_mask=ttt_block_mask(length, step), enable_gqa=True)
    assert counter.frame_count <= 3  # dynamic=False compiled each of the 12 shapes until the recompile limit (8)


def test_device_map_reaches_the_target_loader_online(chat_target, data_file, tmp_path, monkeypatch):
    import importlib.util

    from eaglekit.targets import loading

    real_find_spec, real_load = importlib.util.find_spec, loading.load_target
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "accelerate" else real_find_spec(name, *a))
    seen = []

    def load_target(name, device="cpu", dtype=torch.float32, trust_remote_code=False, device_map=None):
        seen.append(device_map)  # accelerate is not installed here: load as one piece after recording the argument
        return real_load(name, device, dtype, trust_remote_code=trust_remote_code)

    monkeypatch.setattr(loading, "load_target", load_target)
    train(options(chat_target, data_file, tmp_path / "mapped", device_map="auto"))
    assert seen == ["auto"]
    manifest = json.loads((tmp_path / "mapped" / "manifest.json").read_text())
    assert manifest["config"]["device_map"] == "auto" and manifest["mode"] == "online"


def test_device_map_is_refused_offline_under_torchrun_and_without_accelerate(chat_target, data_file, tmp_path, monkeypatch):
    with pytest.raises(EaglekitError, match="drop device_map"):
        train_setup._check(options(chat_target, data_file, tmp_path / "a", data=[], shards=str(tmp_path), device_map="auto"), 1)
    with pytest.raises(EaglekitError, match="single process"):
        train_setup._check(options(chat_target, data_file, tmp_path / "b", device_map="auto"), 2)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a))
    with pytest.raises(EaglekitError, match=r"needs the `accelerate` package.*pip install 'eaglekit\[multi-gpu\]'"):
        train_setup._check(options(chat_target, data_file, tmp_path / "c", device_map="auto"), 1)
