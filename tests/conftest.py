"""Shared test fixtures. Tests run on the CPU, offline, with tiny models built from configs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))  # `make test`'s two workers: OMP_NUM_THREADS=1, one each


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def build_chat_target(directory) -> str:
    """A tiny random Llama + byte-level BPE tokenizer with a chat template, saved to `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "user assistant system hello world", "what is two plus two"]
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                        pad_token="<|pad|>", chat_template=template)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory) -> str:
    """Directory of a tiny random chat model (config.json, weights, tokenizer with a chat template)."""
    return build_chat_target(tmp_path_factory.mktemp("chat_target"))


RUN_TOPICS = ["the quick brown fox", "the lazy dog", "hello world", "what is two plus two", "jumps over the dog",
              "brown fox says hello", "two plus two is four", "the world is lazy"]


@pytest.fixture
def run_prompts(tmp_path) -> str:
    """A small prompt file (OpenAI messages) for the `eaglekit run` tests."""
    import json

    path = tmp_path / "prompts.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
               for i, t in enumerate(RUN_TOPICS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def drafter_dir(chat_target, tmp_path_factory):
    """An untrained drafter shaped for the chat target (the bad-input tests)."""
    from user_errors import save_drafter

    return save_drafter(tmp_path_factory.mktemp("drafter") / "drafter", chat_target, chat_target)


@pytest.fixture
def data(tmp_path):
    """Twelve one-turn conversations in a JSONL file (the bad-input tests)."""
    from user_errors import CHAT, write_jsonl

    return write_jsonl(tmp_path / "data.jsonl", [{"id": f"r{i}", "messages": CHAT} for i in range(12)])


@pytest.fixture(scope="session")
def tiny_answers(tmp_path_factory) -> str:
    """The built-in tiny target's own greedy answers to 32 shipped prompts (40 new tokens), made once per session."""
    from engines import own_answers

    return own_answers("tiny", tmp_path_factory.mktemp("tiny_answers"), records=32, new_tokens=40)


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_answers):
    """`tiny_drafter(**flags)`: an EAGLE-3 drafter trained for 30 steps on `tiny_answers` with the drafter
    options `flags`, trained once per session for each set of flags (training is seeded: the same flags give the
    same drafter in every test that asks)."""
    from engines import train_drafter

    trained: dict[tuple, str] = {}

    def drafter(**flags) -> str:
        key = tuple(sorted(flags.items()))
        if key not in trained:
            name = "_".join(f"{k}-{v}" for k, v in key) or "eagle3"
            trained[key] = train_drafter("tiny", tmp_path_factory.mktemp(f"tiny_drafter_{name}"), steps=30, lr=2e-3,
                                         data=tiny_answers, **flags)
        return trained[key]

    return drafter
