"""Tiny target, drafter and data builders shared by the decode and train tests (a library for them: holds no tests)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.targets.capture import default_aux_layers

VOCAB = 96


def tiny_target(kind: str, seed: int = 0) -> nn.Module:
    """A tiny random HF causal LM: llama | qwen3_moe | deepseek_v3 | qwen3."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "llama":
        config = tf.LlamaConfig(**common)
    elif kind == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=8)
    elif kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    elif kind == "deepseek_v3":
        config = tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties, more structure
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


def random_drafter(target: nn.Module, seed: int = 1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = target.config
    layers = config.num_hidden_layers
    drafter = Eagle3Drafter(DrafterConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        draft_vocab_size=64, target_hidden_size=config.hidden_size, aux_layer_ids=default_aux_layers(layers)))
    drafter.set_vocab_mapping(torch.arange(0, 2 * 64, 2) % VOCAB if 2 * 64 <= VOCAB else torch.arange(64) + 7)
    drafter.load_target_embedding(target.get_input_embeddings().weight)
    return drafter.eval()


class OracleDrafter(nn.Module):
    """A drafter stand-in whose top-1 guess at position p is `sequence[p + 2]` (the target's greedy
    continuation, computed beforehand): every greedy draft is accepted. Other candidates are random."""

    def __init__(self, sequence: list[int], num_layers: int, vocab_size: int = VOCAB, seed: int = 2):
        super().__init__()
        self.sequence = sequence
        self.vocab_size = vocab_size
        self.fc = nn.Linear(1, 1, bias=False)
        self.config = type("C", (), {"aux_layer_ids": default_aux_layers(num_layers), "aux_layer_convention": "input_of_layer"})
        self.generator = torch.Generator().manual_seed(seed)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux[..., :4]

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def forward(self, hidden, input_ids, position_ids, past_kv=None, mask=None):
        b, t = input_ids.shape
        logits = torch.randn(b, t, self.vocab_size, generator=self.generator)
        for j, p in enumerate(position_ids[0].tolist()):
            if p + 2 < len(self.sequence):
                logits[0, j, self.sequence[p + 2]] = 20.0
        kv = torch.zeros(b, 1, t, 1)
        return hidden, logits, (kv, kv)


def both_ttt_paths(drafter: nn.Module, aux, ids, loss_mask, probs, in_vocab, num_steps: int):
    """`ttt_forward` and `naive_ttt_forward` on one batch, each backpropagated -> (fast, slow, fast's gradients by
    parameter name); afterwards the drafter's `.grad` holds the naive path's gradients."""
    from eaglekit.drafters.eagle3.ttt import naive_ttt_forward, ttt_forward

    fast = ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=num_steps)
    fast.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    slow = naive_ttt_forward(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=num_steps)
    slow.loss.backward()
    return fast, slow, grads


WORDS = "the quick brown fox jumps over the lazy dog hello world what is two plus".split()


def write_random_chats(path: Path, count: int, answer_words: tuple[int, int], seed: int = 0) -> Path:
    """`count` one-turn chats of random WORDS (questions of 2..6 words, answers of `answer_words` words) as
    JSON lines at `path`."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*answer_words)))
            handle.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": question},
                                                                 {"role": "assistant", "content": answer}]}) + "\n")
    return path


def sampled_against_plain(decoder, prompts, method: str, samples: int, **options) -> tuple[list, list, int]:
    """`samples` seeded draws of 3 tokens at T=1 from the first two `prompts`, plain and with `method` (chain of 2;
    `options`: more decode options) -> (plain outputs, speculative outputs, drafts accepted in all), for a test of the
    output distribution."""
    plain, speculative, accepted = [], [], 0
    for seed in range(samples):
        prompt = prompts[seed % 2]
        plain.append(decoder.generate(prompt, 3, method="plain", temperature=1.0, seed=seed).tokens)
        result = decoder.generate(prompt, 3, method=method, chain_length=2, temperature=1.0, seed=10_000 + seed,
                                  **options)
        speculative.append(result.tokens[:3])
        accepted += sum(result.stats.accepted)
    return plain, speculative, accepted


def killed_and_resumed(options, directory: Path, kill_at: int = 3, after_kill=None) -> tuple[dict, dict]:
    """Train `options(directory / "a")` to the end, then `options(directory / "b")` killed at optimizer step
    `kill_at` and run again with `options(..., resume=True)` (`after_kill()` runs in between) -> the final tensors of
    the uninterrupted and of the resumed run, {name: tensor} each."""
    import pytest
    from safetensors.torch import load_file

    from eaglekit.training.loop import train

    train(options(directory / "a"))

    def crash(step: int, trainer) -> None:
        if step == kill_at:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(options(directory / "b"), step_callback=crash)
    if after_kill is not None:
        after_kill()
    train(options(directory / "b", resume=True))
    return load_file(str(directory / "a/model.safetensors")), load_file(str(directory / "b/model.safetensors"))
