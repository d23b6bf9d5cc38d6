"""Reading conversation records: every format, JSON/JSONL/datasets sources, malformed records, stable ids."""

from __future__ import annotations

import json
import logging

import pytest

from eaglekit.data import Conversation, Message, content_id, load_conversations, parse_record, read_conversations
from eaglekit.errors import EaglekitError

OPENAI = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}]}
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello"}]}
PLAIN = {"prompt": "Hi", "completion": "Hello", "system": "Be brief."}
EXPECTED = (Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello"))


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_formats_parse_to_the_same_messages():
    assert parse_record(SHAREGPT).messages == EXPECTED
    assert parse_record(PLAIN).messages == EXPECTED
    assert parse_record(OPENAI).messages == EXPECTED[:2] + (Message("assistant", "Hello", "greet back"),)
    variants = {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello"}], "system": "Be brief."}
    assert parse_record(variants).messages == EXPECTED
    parts = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
                          {"role": "assistant", "content": "Hello"}]}
    assert parse_record(parts).messages == EXPECTED
    assert parse_record({"prompt": "Hi"}).messages == (Message("user", "Hi"),)  # prompt-only data, for regen


def test_ids_are_stable_and_independent_of_position(tmp_path):
    conversation = parse_record(SHAREGPT)
    assert conversation.id == content_id(EXPECTED) == "9a8ccae98f7ac5c9"  # sha256 of the canonical JSON: the same on every run
    assert parse_record(PLAIN).id == conversation.id  # same content, same id, whatever the format
    assert parse_record({**OPENAI, "id": 17}).id == "17"
    a = write_jsonl(tmp_path / "a.jsonl", [PLAIN, {"prompt": "Other"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "Other"}, {"prompt": "Third"}, PLAIN])
    ids_a = {c.messages: c.id for c in read_conversations(a)}
    ids_b = {c.messages: c.id for c in read_conversations(b)}
    assert all(ids_b[messages] == ids for messages, ids in ids_a.items())


def test_duplicates(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [PLAIN, PLAIN, PLAIN, {"id": "x", "prompt": "a"}, {"id": "x", "prompt": "a"}])
    ids = [c.id for c in read_conversations(path)]
    base = content_id(EXPECTED)
    assert ids == [base, f"{base}#2", f"{base}#3", "x", "x#2"]
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    with pytest.raises(EaglekitError, match=r"clash.jsonl:2: id 'x' is already used by .*clash.jsonl:1"):
        read_conversations(clash)


def test_malformed_lines_stop_or_skip(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [PLAIN, "{not json", "", {"messages": [{"role": "robot", "content": "x"}]},
                                                  {"text": "no format"}, SHAREGPT, {"messages": [{"role": "user", "content": None}]}])
    with pytest.raises(EaglekitError, match=r"bad.jsonl:2: not valid JSON.*skip_errors=true"):
        read_conversations(path)
    with caplog.at_level(logging.WARNING):
        result = load_conversations(path, skip_errors=True)
    assert result.skipped == 4 and len(result.conversations) == 2
    assert [e.split(": ", 1)[0].rsplit(":", 1)[1] for e in result.errors] == ["2", "4", "5", "7"]
    assert "role 'robot'" in result.errors[1] and "unknown record format" in result.errors[2] and "no content" in result.errors[3]
    assert "skipped 4 malformed record(s) of 6" in caplog.text
    with pytest.raises(EaglekitError, match="all 1 records were malformed"):
        load_conversations(write_jsonl(tmp_path / "allbad.jsonl", ["[1, 2]"]), skip_errors=True)


def test_json_array_reports_the_line_of_the_record(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([PLAIN, SHAREGPT, {"prompt": 5}, OPENAI], indent=2))
    with pytest.raises(EaglekitError) as error:
        read_conversations(path)
    starts = [i + 1 for i, text in enumerate(path.read_text().splitlines()) if text == "  {"]  # where each record opens
    assert len(starts) == 4 and f"data.json:{starts[2]}: prompt content must be a string" in str(error.value)
    assert len(load_conversations(path, skip_errors=True).conversations) == 3
    single = tmp_path / "one.json"
    single.write_text(json.dumps(SHAREGPT))
    assert read_conversations(single)[0].messages == EXPECTED
    lines_named_json = write_jsonl(tmp_path / "lines.json", [PLAIN, SHAREGPT])
    assert len(read_conversations(lines_named_json)) == 2
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"prompt": "a"},\n{"prompt": \n')
    with pytest.raises(EaglekitError, match=r"broken.json:\d+: not valid JSON"):
        read_conversations(broken, skip_errors=True)


def test_paths_and_directories(tmp_path):
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl", [PLAIN])
    write_jsonl(tmp_path / "dir" / "b.jsonl", [{"prompt": "Other"}])
    assert [c.messages[-1].content for c in read_conversations(tmp_path / "dir")] == ["Hello", "Other"]
    assert len(read_conversations([tmp_path / "dir" / "a.jsonl", str(tmp_path / "dir" / "b.jsonl")])) == 2
    with pytest.raises(EaglekitError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")
    with pytest.raises(EaglekitError, match="no data given"):
        read_conversations([])


def test_huggingface_datasets_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "r0", **OPENAI}, {"id": "r1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    from_disk = read_conversations(saved)
    assert [c.id for c in from_disk] == ["r0", "r1"] and from_disk[0].messages[2].reasoning == "greet back"
    assert from_disk[1].messages[1] == Message("assistant", "Yo")  # None-filled reasoning column is ignored
    split_dict = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}).save_to_disk(str(split_dict))
    assert [c.id for c in read_conversations(split_dict)] == ["r0"]
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    datasets.Dataset.from_list([SHAREGPT]).to_parquet(str(parquet_dir / "part-0.parquet"))
    assert read_conversations(parquet_dir)[0] == Conversation(content_id(EXPECTED), EXPECTED)
    bad = tmp_path / "badrows"
    datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}]).save_to_disk(str(bad))
    with pytest.raises(EaglekitError, match=r"badrows\[row 0\]: unknown record format"):
        read_conversations(bad)
