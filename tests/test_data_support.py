"""Shared pieces for the data-layer tests: a small BPE tokenizer trained offline with `tokenizers`
(with the special tokens of the fixture chat templates), a tiny target directory, and the golden cases.

Regenerate the golden masks after a deliberate rule change (then read the diff!):
    .venv/bin/python tests/test_data_support.py
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
GOLDEN = FIXTURES / "golden_masks"
TEMPLATE_NAMES = ("llama3", "chatml", "deepseek", "gemma", "qwen3")

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",  # Llama-3
    "<|im_start|>", "<|im_end|>",  # ChatML
    "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",  # DeepSeek
    "<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>",  # Gemma
]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special (as in DeepSeek/Qwen3 tokenizers)
CORPUS = [
    "The cat sat on the mat. The dog ran in the park.",
    "What is the capital of France? The capital of France is Paris.",
    "You are a helpful assistant. Answer briefly and politely.",
    "Let me think: two plus two is four, so the answer is 4.",
    "user assistant system model Cutting Knowledge Date: December 2023",
    "Hello! How can I help you today? Thanks, goodbye.",
]


def build_chat_tokenizer(chat_template: str | None = None):
    """A deterministic byte-level BPE tokenizer (~400 tokens) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<pad>")
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = chat_template
    return tokenizer


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def build_target_dir(directory: Path, template: str | None = "llama3") -> Path:
    """A tiny random Llama plus the test tokenizer (with a chat template), saved like a user's model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_chat_tokenizer(template_text(template) if template else None)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# name -> OpenAI-format messages; the same conversations go through every template.
CASES = {
    "single_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    "system_two_turns": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
    ],
    "reasoning_two_turns": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think: two plus two is four."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Goodbye!", "reasoning_content": "The user says thanks."},
    ],
    "prompt_only": [
        {"role": "user", "content": "The cat sat on the mat."},
    ],
}


def learned_segments(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """The decoded text of each run of loss-masked tokens."""
    segments, run = [], []
    for token, learned in zip(input_ids + [None], loss_mask + [0]):
        if learned:
            run.append(token)
        elif run:
            segments.append(tokenizer.decode(run))
            run = []
    return segments


def golden_record(template_name: str) -> dict:
    """What the golden file of one template holds: per case, the rendered text and the learned segments."""
    from eaglekit.data import parse_record, tokenize_conversation

    tokenizer = build_chat_tokenizer(template_text(template_name))
    out = {}
    for case, messages in CASES.items():
        record = tokenize_conversation(tokenizer, parse_record({"messages": messages}), max_length=None)
        out[case] = {
            "text": tokenizer.decode(record.input_ids),
            "num_tokens": record.num_tokens,
            "num_learned": record.num_learned,
            "learned": learned_segments(tokenizer, record.input_ids, record.loss_mask),
        }
    return out


def test_special_tokens_are_single_tokens():
    tokenizer = build_chat_tokenizer()
    for token in SPECIAL_TOKENS + THINK_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token


def test_tokenizer_is_deterministic():
    assert build_chat_tokenizer().get_vocab() == build_chat_tokenizer().get_vocab()


if __name__ == "__main__":
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATE_NAMES:
        path = GOLDEN / f"{name}.json"
        path.write_text(json.dumps(golden_record(name), indent=2, ensure_ascii=False) + "\n")
        print("wrote", path)
