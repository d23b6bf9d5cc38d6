"""Draft vocabulary: golden counts/d2t/t2d, file round trip, drafter mapping kept, lm_head row remapping."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.training.vocab import VocabMapping, count_tokens, load_vocab, remap_rows, save_vocab, select_vocab
from eaglekit.errors import EaglekitError


def test_counts_and_mapping_golden(tmp_path) -> None:
    records = [
        ([5, 1, 1, 7, 3], [0, 1, 1, 1, 0]),  # counted: 1, 1, 7
        ([2, 7, 7, 9], [1, 1, 1, 0]),  # counted: 2, 7, 7
    ]
    counts = count_tokens(records, 10)
    assert counts.tolist() == [0, 2, 1, 0, 0, 0, 0, 3, 0, 0]
    mapping = select_vocab(counts, 3)
    assert mapping.used_ids.tolist() == [1, 2, 7]
    assert mapping.d2t.tolist() == [1, 1, 5]  # offsets: target = draft + d2t[draft]
    assert mapping.t2d.nonzero().flatten().tolist() == [1, 2, 7]
    assert mapping.coverage() == pytest.approx(1.0)
    assert select_vocab(counts, 2).coverage() == pytest.approx(5 / 6)
    # ties broken by the lower id; a size past the vocabulary keeps everything
    assert select_vocab(counts, 4).used_ids.tolist() == [0, 1, 2, 7]
    assert select_vocab(counts, 99).used_ids.tolist() == list(range(10))
    path = save_vocab(tmp_path / "vocab.safetensors", mapping)
    loaded = load_vocab(tmp_path)
    assert path.is_file() and torch.equal(loaded.used_ids, mapping.used_ids) and torch.equal(loaded.counts, counts)
    drafter = Eagle3Drafter(DrafterConfig(32, 64, 4, 2, 10, 3, 16, (1, 2, 3)))
    drafter.set_vocab_mapping(mapping.used_ids)
    assert torch.equal(drafter.d2t, mapping.d2t) and torch.equal(drafter.t2d, mapping.t2d)


def test_token_outside_vocabulary_is_a_clear_error() -> None:
    with pytest.raises(EaglekitError, match="another tokenizer"):
        count_tokens([([3, 12], [1, 1])], 10)


def test_remap_rows_moves_kept_ids_and_inits_new_ones() -> None:
    old_ids, new_ids = torch.tensor([1, 4, 6, 9]), torch.tensor([0, 4, 9])
    weight = torch.arange(8.0).view(4, 2)  # row i belongs to old draft id i
    fresh = torch.full((3, 2), -1.0)
    out, kept = remap_rows(weight, old_ids, new_ids, fresh)
    assert kept == 2
    assert out.tolist() == [[-1.0, -1.0], [2.0, 3.0], [6.0, 7.0]]


def test_vocab_stage_from_shards_and_keeping_a_drafter_mapping(tmp_path, monkeypatch) -> None:
    """Stand-in for `eaglekit.targets.store.HiddenStateDataset` (per docs/CONTRACTS.md): one shard file holding only the
    token tensors; reading a record's hidden states (`__getitem__`) fails the test."""
    from safetensors.torch import save_file

    save_file({"input_ids": torch.tensor([3, 3, 5, 8], dtype=torch.int32), "loss_mask": torch.tensor([0, 1, 1, 1], dtype=torch.uint8),
               "offsets": torch.tensor([0, 4], dtype=torch.int64)}, str(tmp_path / "shard.safetensors"))

    class FakeDataset:
        manifest = {"vocab_size": 12, "target": "fake", "shards": [{"file": "shard.safetensors"}]}
        directory = tmp_path

        def __init__(self, directory: str) -> None:
            pass

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> dict:
            raise AssertionError("vocab shards= must count from the token tensors, not load hidden states")

    monkeypatch.setitem(sys.modules, "eaglekit.targets.store", types.SimpleNamespace(HiddenStateDataset=FakeDataset))
    from eaglekit.stages import vocab as stage

    result = stage.run(stage.Config(shards="x", output=str(tmp_path / "v"), size=2))
    assert load_vocab(tmp_path / "v").used_ids.tolist() == [3, 5]
    assert result["coverage"] == pytest.approx(2 / 3)
    drafter = Eagle3Drafter(DrafterConfig(32, 64, 4, 2, 12, 2, 16, (1, 2, 3)))
    drafter.set_vocab_mapping(torch.tensor([5, 11]))
    drafter.save_pretrained(tmp_path / "d")
    kept = stage.run(stage.Config(shards="x", output=str(tmp_path / "k"), size=2, init_from=str(tmp_path / "d")))
    assert load_vocab(tmp_path / "k").used_ids.tolist() == [5, 11] and kept["coverage"] == pytest.approx(1 / 3)
    rebuilt = stage.run(stage.Config(shards="x", output=str(tmp_path / "r"), size=2, init_from=str(tmp_path / "d"), rebuild=True))
    assert load_vocab(tmp_path / "r").used_ids.tolist() == [3, 5] and rebuilt["mapping"] == "built from counts"
    assert (tmp_path / "r" / "manifest.json").is_file()
    assert isinstance(VocabMapping(torch.tensor([0]), 1).coverage(), float)


def test_vocab_stage_from_conversations_counts_assistant_tokens(chat_target, tmp_path):
    import json

    from eaglekit.data import read_conversations, tokenize_conversation
    from eaglekit.stages import vocab as stage
    from eaglekit.targets.loading import load_tokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "what is two plus two"},
                                                                      {"role": "assistant", "content": "the quick fox " * (i + 1)}]})
                                for i in range(3)) + "\n")
    result = stage.run(stage.Config(data=(str(data),), target=chat_target, output=str(tmp_path / "v"), size=5))
    tokenizer = load_tokenizer(chat_target)
    expected = torch.zeros(len(tokenizer), dtype=torch.long)
    for conversation in read_conversations([data]):
        record = tokenize_conversation(tokenizer, conversation, 2048)
        for token, learn in zip(record.input_ids, record.loss_mask):
            expected[token] += learn
    mapping = load_vocab(tmp_path / "v")
    assert torch.equal(mapping.counts, expected) and result["tokens_counted"] == int(expected.sum())
    assert mapping.used_ids.tolist() == sorted(torch.argsort(-expected, stable=True)[:5].tolist())
