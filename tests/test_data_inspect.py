"""`eaglekit inspect`: per-record token counts and the learned text, through the real CLI."""

from __future__ import annotations

import json

import pytest

from eaglekit.cli import main
from test_data_support import CASES, GOLDEN, build_target_dir


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_target_dir(tmp_path_factory.mktemp("inspect_target"), "llama3")


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps({"id": "one", "messages": CASES["single_turn"]}), "{broken",
             json.dumps({"id": "two", "messages": CASES["system_two_turns"]}), json.dumps({"id": "three", "messages": CASES["prompt_only"]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_inspect_prints_counts_and_marked_text(target_dir, data_file, capsys):
    golden = json.loads((GOLDEN / "llama3.json").read_text())
    assert main(["inspect", str(data_file), "--target", str(target_dir), "--skip_errors"]) == 0
    out = capsys.readouterr().out
    single, two = golden["single_turn"], golden["system_two_turns"]
    assert f"[1/3] id=one  tokens={single['num_tokens']}  learned={single['num_learned']}  not truncated" in out
    assert f"[2/3] id=two  tokens={two['num_tokens']}  learned={two['num_learned']}  not truncated" in out
    assert "[3/3] id=three  tokens=38  learned=0" in out
    marked = single["text"].replace(single["learned"][0], f"⟦{single['learned'][0]}⟧")
    assert marked in out  # exactly the golden learned span is marked, nothing else
    assert out.count("⟦") == 3 and "⟦Two plus two is four.<|eot_id|>⟧" in out
    tokens = single["num_tokens"] + two["num_tokens"] + 38
    learned = single["num_learned"] + two["num_learned"]
    assert (f"3 conversations: {tokens} tokens, {learned} learned ({100 * learned / tokens:.1f}%), 0 truncated at max_length=2048, "
            "1 with nothing to learn, 1 malformed skipped") in out


def test_inspect_truncation_limit_and_report(target_dir, data_file, tmp_path, capsys):
    report = tmp_path / "out" / "inspect.json"
    args = ["inspect", str(data_file), "--target", str(target_dir), "--skip_errors", "--max_length", "40", "--limit", "2",
            "--show_text", "false", f"output={report}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[1/2] id=one  tokens=40  learned=0  truncated: kept 40 of 55 (max_length=40)" in out
    assert "⟦" not in out and "(the first 2 of 3)" in out
    data = json.loads(report.read_text())
    assert data["totals"]["truncated"] == 2 and [r["tokens"] for r in data["records"]] == [40, 40]
    assert (report.parent / "inspect.config.yaml").is_file()


def test_inspect_errors(target_dir, data_file, tmp_path, capsys):
    assert main(["inspect", str(data_file), "--target", str(target_dir)]) == 1
    assert "chat.jsonl:2: not valid JSON" in capsys.readouterr().err
    bare = build_target_dir(tmp_path / "bare", None)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": CASES["single_turn"]}) + "\n")
    assert main(["inspect", str(good), "--target", str(bare)]) == 1
    assert "has no chat template; pass chat_template=" in capsys.readouterr().err
    template = GOLDEN.parent / "chat_templates" / "chatml.jinja"
    assert main(["inspect", str(good), "--target", str(bare), "--chat-template", str(template)]) == 0
    assert "⟦The capital of France is Paris.<|im_end|>⟧" in capsys.readouterr().out
