"""bench's confidence-cut sweep (`verify_thresholds=`): a DSpark drafter measured uncut and at each threshold, each
row with the drafts verified per step and the share of them accepted; bench.md's sweep table; a sweep without a
method that has a confidence cut is refused before anything runs."""

from __future__ import annotations

import json

import pytest

from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.stages import bench
from test_dspark_format import chat_dspark


def test_bench_sweeps_the_confidence_cut(chat_target, tmp_path):
    chat_dspark(chat_target, tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                               for text in ("what is two plus two", "hello world")))
    common = [f"prompts={prompts}", f"target={chat_target}", f"drafter={tmp_path / 'drafter'}", "device=cpu",
              "max_new_tokens=8", "repeats=1", "remeasure=0", "temperatures=0"]
    result = bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'b'}",
                                                        "methods=plain,dspark", "chain_length=4",
                                                        "verify_thresholds=0,0.5,0.9"]))
    rows = {(r["method"], r.get("verify_threshold", 0)): r for r in result["rows"]}
    assert set(rows) == {("plain", 0), ("dspark", 0), ("dspark", 0.5), ("dspark", 0.9)}
    assert rows["dspark", 0]["verified_per_step"] == 4  # uncut: every draft of the chain
    for threshold in (0.5, 0.9):
        row = rows["dspark", threshold]
        assert 0 <= row["verified_per_step"] <= 4 and row["new_tokens"] == rows["dspark", 0]["new_tokens"]
        assert row["accepted_of_verified"] is None or 0 <= row["accepted_of_verified"] <= 1
    assert rows["dspark", 0.9]["verified_per_step"] <= rows["dspark", 0.5]["verified_per_step"]  # a higher bar
    table = (tmp_path / "b" / "bench.md").read_text()
    assert "| dspark (verify >= 0.5) | 0 |" in table and "| dspark | 0 | 0.9 |" in table
    assert "| method | T | verify_threshold | drafts verified per step | accepted of verified | tau | speed-up |" in table
    with pytest.raises(EaglekitError, match="verify_thresholds=0.5 sweeps the confidence cut of a method that has "
                                            "one, and methods=plain,tree has none: add method dspark"):
        bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'c'}", "methods=plain,tree",
                                                   "verify_thresholds=0.5"]))
    assert not (tmp_path / "c").exists()


def test_bench_drafts_dspark_on_the_markov_candidates_asked(chat_target, tmp_path):
    chat_dspark(chat_target, tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "what is two plus two"}]}) + "\n")
    common = [f"prompts={prompts}", f"target={chat_target}", f"drafter={tmp_path / 'drafter'}", "device=cpu",
              "max_new_tokens=8", "repeats=1", "remeasure=0", "temperatures=0", "chain_length=4"]
    result = bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'b'}", "methods=plain,dspark",
                                                        "draft_topk=2"]))
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["dspark"]["new_tokens"] == rows["plain"]["new_tokens"] and rows["dspark"]["tau"] >= 1
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["config"]["draft_topk"] == 2
    with pytest.raises(EaglekitError, match="draft_topk=2 sets the candidates of a Markov head's correction, and "
                                            "methods=plain has none"):
        bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'c'}", "methods=plain",
                                                   "draft_topk=2"]))
    assert not (tmp_path / "c").exists()


def test_bench_measures_the_drafters_own_methods_and_refuses_the_others_before_loading(chat_target, tmp_path,
                                                                                       monkeypatch):
    """Left at the default methods, a DSpark drafter is measured with dspark (not chain and tree, which it cannot
    draft); a method named that it cannot draft, or a chain longer than its block, is one error before the target
    loads, nothing written."""
    import eaglekit.targets.loading

    chat_dspark(chat_target, tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "what is two plus two"}]}) + "\n")
    common = [f"prompts={prompts}", f"target={chat_target}", f"drafter={tmp_path / 'drafter'}", "device=cpu",
              "max_new_tokens=8", "repeats=1", "remeasure=0", "temperatures=0", "warmup=0"]
    result = bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'b'}"]))
    assert [r["method"] for r in result["rows"]] == ["plain", "hf", "hf_prompt_lookup", "dspark"]
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["config"]["methods"][-1] == "dspark"

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the methods were checked")

    monkeypatch.setattr(eaglekit.targets.loading, "load_target", no_loading)
    for options, message in {("methods=plain,tree",): "method=tree needs a drafter of type eagle3 or p-eagle; this "
                                                      "drafter is dspark: use method=dspark",
                             ("methods=dspark", "chain_length=60"): "chain_length=60: this DSpark drafter's block "
                                                                    "makes at most"}.items():
        with pytest.raises(EaglekitError, match=message):
            bench.run(load_config(bench.Config, None, [*common, f"output={tmp_path / 'c'}", *options]))
        assert not (tmp_path / "c").exists()
