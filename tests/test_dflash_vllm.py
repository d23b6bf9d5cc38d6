"""A DFlash drafter served by the real vLLM (`"method": "dflash"`) drafts what eaglekit's decoder drafts: the same
acceptance per position on the same prompts (T=0, fp32), and vLLM's greedy output kept. One vLLM worker start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.vllm import engine as ve
from eaglekit.stages import bench

pytestmark = pytest.mark.engine

NUM_PROMPTS, NEW_TOKENS, DRAFTS = 4, 32, 3


def train_dflash(output: Path, steps: int = 30) -> str:
    """A one-layer DFlash drafter (blocks of 4) trained online on the shipped prompts for `steps` steps."""
    from eaglekit.training.loop import train
    from eaglekit.config.train import TrainConfig

    config = TrainConfig(drafter_type="dflash", target="tiny", data=(str(engines.PROMPTS),), output=str(output),
                         draft_vocab_size=1024, block_size=DRAFTS + 1, draft_layers=1, num_anchors=16, step_decay=0.9,
                         max_steps=steps, batch_size=4, max_length=192, lr=3e-3, warmup_steps=2, val_fraction=0.0,
                         log_every=1000, save_every=100000, device="cpu", dtype="fp32")
    train(config)
    return str(output)


@pytest.fixture(scope="module")
def benched(tmp_path_factory) -> tuple[Path, dict]:
    """One `bench engine=vllm methods=dflash` run on the tiny target, offline only: (output dir, bench.json)."""
    python = engines.vllm_python()
    root = tmp_path_factory.mktemp("dflash_vllm")
    drafter = train_dflash(root / "drafter")
    output = root / "bench"
    overrides = [f"prompts={engines.EVAL_PROMPTS}", "target=tiny", f"drafter={drafter}", "methods=dflash",
                 f"chain_length={DRAFTS}", "temperatures=0", f"num_prompts={NUM_PROMPTS}",
                 f"max_new_tokens={NEW_TOKENS}", "repeats=1", "warmup=0", "device=cpu", f"output={output}",
                 "engine=vllm", f"vllm_python={python}", "concurrency="]
    bench.run(load_config(bench.Config, None, overrides))
    return output, json.loads((output / "bench.json").read_text())


def test_vllm_dflash_acceptance_equals_eaglekit(benched):
    output, result = benched
    rows = {r["method"]: r for r in result["rows"] if r["temperature"] == 0.0}
    ours, served, plain = rows["dflash"], rows["vllm_dflash"], rows["vllm_plain"]
    assert ours["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    assert len(served["acceptance_per_position"]) == DRAFTS
    assert served["acceptance_per_position"] == pytest.approx(ours["acceptance_per_position"], abs=0.02)
    assert served["tau"] == pytest.approx(ours["tau"], abs=0.05)
    assert served["outputs_equal_plain"] == 1.0  # greedy speculative decoding kept vLLM's own greedy output
    assert served["engine_version"] == ve.TESTED_VERSION and plain["new_tokens"] == served["new_tokens"]
    config = json.loads((output / "vllm" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"]
    assert ve.processes_of(output) == []  # the worker stopped
