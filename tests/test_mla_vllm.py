"""The MLA drafter (drafter_arch=mla) served by the real vLLM 0.32.0 (CPU) as `Eagle3DeepseekV2ForCausalLM` beside a
tiny random DeepSeek-V3 target (MLA + MoE), against eaglekit's own decoder.

Pipeline as a user runs it: regen of the target's own greedy answers, `train drafter_arch=mla` (its MLA dims from
the target's config) for a few dozen steps, then one `bench engine=vllm methods=chain chain_length=3` (offline
vLLM runs with and without the drafter in one worker process). vLLM's acceptance per position (its spec-decode
counters) must equal eaglekit's chain figures within 0.01 at T=0, fp32, and vLLM's greedy output must be the
target's (eaglekit's plain decoding), so that both compare the same drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.stages import bench

pytestmark = pytest.mark.engine

NUM_PROMPTS, NEW_TOKENS, DRAFTS = 4, 32, 3


def train_mla_drafter(target: str, output: Path, data: str) -> str:
    from eaglekit.draft.train import train
    from eaglekit.train_config import TrainConfig

    train(TrainConfig(target=target, data=(data,), output=str(output), drafter_arch="mla", draft_vocab_size=512,
                      ttt_steps=3, max_steps=20, batch_size=4, max_length=96, lr=3e-3, warmup_steps=2,
                      val_fraction=0.0, log_every=1000, save_every=100000, device="cpu", dtype="fp32"))
    return str(output)


@pytest.fixture(scope="module")
def benched(tmp_path_factory) -> tuple[Path, dict, str]:
    python = engines.vllm_python()
    root = tmp_path_factory.mktemp("mla_vllm")
    target = engines.random_target("deepseek_v3", root / "target")
    answers = engines.own_answers(target, root / "regen", records=16, new_tokens=32)
    drafter = train_mla_drafter(target, root / "drafter", answers)
    output = root / "bench"
    config = load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", f"target={target}", f"drafter={drafter}", "methods=chain",
        f"chain_length={DRAFTS}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", f"output={output}", "engine=vllm", f"vllm_python={python}",
        "concurrency="])
    bench.run(config)
    return output, json.loads((output / "bench.json").read_text()), drafter


def test_vllm_serves_the_mla_drafter_with_eaglekits_acceptance(benched):
    output, result, drafter = benched
    exported = json.loads((output / "vllm" / "drafter" / "config.json").read_text())
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["kv_lora_rank"] == 512
    rows = {r["method"]: r for r in result["rows"]}
    chain, eagle = rows["chain"], rows["vllm_eagle3"]
    assert chain["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    assert eagle["acceptance_per_position"] == pytest.approx(chain["acceptance_per_position"], abs=0.01)
    assert eagle["tau"] == pytest.approx(chain["tau"], abs=0.03)
    assert eagle["outputs_equal_plain"] == 1.0  # speculative greedy kept vLLM's own greedy output


def test_the_trained_drafter_is_mla_with_the_targets_dims(benched):
    from eaglekit.draft.model import Eagle3Drafter

    _, _, drafter = benched
    config = Eagle3Drafter.from_pretrained(drafter).config
    assert config.drafter_arch == "mla"
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (64, 512, 32, 64, 32)  # engines.random_target's DeepSeek-V3
