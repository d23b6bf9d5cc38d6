"""Learning test: on the built-in tiny target, a drafter trained on the CPU for about a minute predicts the
target's next token far better than a unigram baseline.

Measured (built-in tiny target v1, 2 shared CPU cores, settings below: 2 epochs, 44 steps, about
1-2 minutes): first-position validation accuracy 0.337 against a unigram baseline of 0.068 (always predicting
the most frequent assistant token of the training split, scored against the target's argmax on the same
validation positions). The test asserts accuracy >= baseline + 0.15 and >= 3x the baseline.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eaglekit.config import load_config
from eaglekit.stages import train as stage
from eaglekit.targets.loading import tiny_target_path

PROMPTS = tiny_target_path().parent / "tiny_prompts.jsonl"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (tiny_target_path() / "config.json").is_file() or not PROMPTS.is_file(),
                       reason="built-in tiny target (src/eaglekit/assets/tiny_target/ + tiny_prompts.jsonl) not present"),
]
SETTINGS = {"target": "tiny", "data": [str(PROMPTS)], "batch_size": 8, "epochs": 2, "ttt_steps": 1, "max_length": 128,
            "draft_vocab_size": 1024, "val_fraction": 0.1, "lr": 3e-3, "warmup_steps": 3, "seed": 0}


@torch.no_grad()
def unigram_baseline(config) -> float:
    """Accuracy on the validation positions of always predicting the most frequent training assistant token."""
    from eaglekit.training.data import conversation_records, split_indices
    from eaglekit.targets.loading import load_target, load_tokenizer

    records = sorted(conversation_records(config.data, load_tokenizer("tiny"), config.max_length), key=lambda r: r["id"])
    train_idx, val_idx = split_indices(len(records), config.val_fraction, config.split_seed)
    counts = Counter(t for i in train_idx for t in records[i]["input_ids"][records[i]["loss_mask"]].tolist())
    top = counts.most_common(1)[0][0]
    target = load_target("tiny")
    hits = total = 0
    for i in val_idx:
        ids, mask = records[i]["input_ids"], records[i]["loss_mask"]
        argmax = target(input_ids=ids[None]).logits[0].argmax(-1)  # (T,) argmax of L_u predicts x_{u+1}
        positions = mask[2:]  # step 0 at t: label argmax L_{t+1}, counted where x_{t+2} is an assistant token
        hits += int(((argmax[1:-1] == top) & positions).sum())
        total += int(positions.sum())
    return hits / total


def test_drafter_beats_unigram_baseline(tmp_path):
    from eaglekit.training.loop import train

    config = load_config(stage.Config, overrides={**SETTINGS, "output": str(tmp_path / "drafter")})
    result = train(config)
    accuracy = result["val"]["acc_k"][0]
    baseline = unigram_baseline(config)
    print(f"first-position validation accuracy {accuracy:.3f}, unigram baseline {baseline:.3f}")
    assert accuracy >= baseline + 0.15 and accuracy >= 3 * baseline, (accuracy, baseline)
