"""Real vLLM serves an eaglekit P-EAGLE drafter (`parallel_drafting: true`) with the acceptance per position that
eaglekit's own decoder gets (`bench methods=parallel`) on the same prompt ids (T=0, fp32).

A small random Qwen3 target (mostly bigram, as in tests/test_vllm_targets.py), a P-EAGLE drafter trained online
for 20 steps on the target's own greedy answers, exported in vLLM's layout (`mask_hidden` and `ptd_token_id`).
After 20 steps the mask slots are rarely accepted (about 34%, 1% and 0% of 92 steps at positions 1-3, the same
counts in both engines), so this checks the first position closely and the mask slots loosely; that the mask slots
draft what one causal forward over the positions and the slots drafts is tests/test_parallel_drafting.py's check.
"""

from __future__ import annotations

import json

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.formats.saved import saved_drafter_type
from eaglekit.vllm import engine as ve
from eaglekit.vllm.bench import export_for_vllm, model_length
from eaglekit.stages import bench
from test_vllm_targets import NEW_TOKENS, NUM_PROMPTS, assert_equal_acceptance, prompt_ids

pytestmark = pytest.mark.engine

DRAFTS = 3


def eaglekit_parallel(target: str, drafter: str, output) -> dict:
    config = load_config(bench.Config, None, [f"prompts={engines.EVAL_PROMPTS}", f"target={target}",
                                              f"drafter={drafter}", "methods=parallel", f"chain_length={DRAFTS}",
                                              "temperatures=0", f"num_prompts={NUM_PROMPTS}",
                                              f"max_new_tokens={NEW_TOKENS}", "repeats=1", "warmup=0", "device=cpu",
                                              f"output={output}"])
    return bench.run(config)["rows"][0]


def test_vllm_parallel_drafting_acceptance_equals_eaglekit(tmp_path) -> None:
    engine = ve.find_engine(engines.vllm_python())
    target = engines.random_target("qwen3", tmp_path / "qwen3")
    answers = engines.own_answers(target, tmp_path / "regen", records=16)
    drafter = engines.train_drafter(target, tmp_path / "drafter", steps=20, lr=2e-3, data=answers,
                                    draft_vocab_size=4096, drafter_type="p-eagle")
    assert saved_drafter_type(drafter) == "p-eagle"
    row = eaglekit_parallel(target, drafter, tmp_path / "bench")
    assert row["method"] == "parallel" and len(row["acceptance_per_position"]) == DRAFTS
    export = export_for_vllm(drafter, tmp_path / "export", DRAFTS)
    exported = json.loads((export / "config.json").read_text())
    assert exported["parallel_drafting"] and exported["ptd_token_id"] == exported["vocab_size"] - 1
    spec = ve.speculative_config(export, DRAFTS)
    assert spec["parallel_drafting"] is True and spec["method"] == "eagle3"
    prompts = prompt_ids()
    args = ve.engine_args(model_length(prompts, NEW_TOKENS, DRAFTS), target, engine.device_type)
    run = {"name": "p-eagle", "model": target, "speculative_config": spec, "prompts": prompts,
           "max_new_tokens": NEW_TOKENS, "engine_args": args, "warmup": False}
    result = ve.run_worker(engine, {"kind": "generate", "runs": [run]}, tmp_path, "parallel")
    assert_equal_acceptance(result["runs"][0], row)
