"""The built-in tiny target: loads through `from_pretrained`, has the promised shape and chat template,
is a real language model on held-out stdlib code, and agrees with its committed training report."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from eaglekit.targets.capture import default_aux_layers, find_decoder
from eaglekit.targets.loading import load_target, load_tokenizer, tiny_target_path

ASSETS = tiny_target_path().parent
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
MARGIN = 3.0  # nats below the uniform baseline ln(V): perplexity at least e^3 = 20x better than uniform


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny"), load_tokenizer("tiny")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((tiny_target_path() / "training_report.json").read_text())


def assistant_positions(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of the whole conversation and the positions of the last answer (+ <|im_end|>): where the
    conversation's tokens first differ from the generation prompt's, up to the closing <|im_end|>."""
    prefix = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prefix_ids, ids)) if a != b), len(prefix_ids))
    end = max(i for i, token in enumerate(ids) if token == tokenizer.convert_tokens_to_ids(IM_END))
    return ids, list(range(start, end + 1))


def test_architecture_is_a_small_llama(tiny):
    model, tokenizer = tiny
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.model_type == "llama"
    assert config.num_hidden_layers == 8 and len(find_decoder(model).layers) == 8
    assert default_aux_layers(8) == (2, 4, 5)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert 128 <= config.hidden_size <= 192 and config.intermediate_size == 3 * config.hidden_size
    assert 1024 <= config.max_position_embeddings <= 2048
    assert config.vocab_size == len(tokenizer) and 2048 <= len(tokenizer) <= 4096
    assert model.dtype == torch.float32 and not model.training
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.convert_tokens_to_ids(IM_END) in model.generation_config.eos_token_id
    size = sum(path.stat().st_size for path in ASSETS.rglob("*") if path.is_file())
    assert size < 10_000_000, f"assets are {size / 1e6:.1f} MB"


def test_chat_template_renders_every_role(tiny):
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (IM_END, ENDOFTEXT, ENDOFTEXT)
    for special in (IM_START, IM_END, ENDOFTEXT):  # each special token is one id, never split into bytes
        assert tokenizer(special, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(special)]
    code = "def f(x):\n    return x ** 2  # quadratic, café ✓\n"
    assert tokenizer.decode(tokenizer(code, add_special_tokens=False)["input_ids"]) == code


def test_heldout_answers_loss_far_below_uniform_and_matches_report(tiny, report):
    model, tokenizer = tiny
    baseline = math.log(len(tokenizer))
    reported = {r["id"]: r for r in report["eval_records"]}
    total_loss, total_tokens = 0.0, 0
    for record in read_jsonl("tiny_prompts_eval.jsonl")[:6]:
        ids, positions = assistant_positions(tokenizer, record["messages"])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)  # (T, V)
        loss_sum = -log_probs[torch.tensor(positions) - 1, torch.tensor(ids)[positions]].sum().item()
        assert len(positions) == reported[record["id"]]["tokens"]
        assert loss_sum == pytest.approx(reported[record["id"]]["loss_sum"], rel=2e-3, abs=1e-2)
        total_loss, total_tokens = total_loss + loss_sum, total_tokens + len(positions)
    assert total_loss / total_tokens < baseline - MARGIN
    assert report["baseline_uniform"] == pytest.approx(baseline, abs=1e-3)
    assert report["eval_loss"] < baseline - MARGIN and report["heldout_loss"] < baseline - MARGIN
    assert report["vocab_size"] == len(tokenizer)


def test_greedy_continuation_is_not_a_loop(tiny):
    model, tokenizer = tiny
    record = read_jsonl("tiny_prompts_eval.jsonl")[0]
    prompt = tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    generated = output[0, ids.shape[1]:].tolist()
    assert len(set(generated)) >= min(8, len(generated) // 2), tokenizer.decode(generated)


def test_prompt_sets_are_heldout_chat_records():
    prompts, evals = read_jsonl("tiny_prompts.jsonl"), read_jsonl("tiny_prompts_eval.jsonl")
    assert len(prompts) == 200 and len(evals) == 30
    ids = [r["id"] for r in prompts + evals]
    assert len(set(ids)) == len(ids)
    prompt_files = {r["id"].split("-", 2)[2].rsplit(":", 1)[0] for r in prompts}
    eval_files = {r["id"].split("-", 2)[2].rsplit(":", 1)[0] for r in evals}
    assert not prompt_files & eval_files, "eval prompts must come from other files than the demo prompts"
    for record in prompts + evals:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant"] and all(m["content"].strip() for m in record["messages"])
    assert report_files_are_heldout(prompt_files | eval_files)


def report_files_are_heldout(files: set[str]) -> bool:
    """The build script's split rule never trains on them."""
    return all(build_script().split_of(f) in ("eval", "prompts") for f in files)


@functools.cache
def build_script():
    """The build script as a module (it lives in scripts/, outside the package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "build_tiny_target.py"
    spec = importlib.util.spec_from_file_location("build_tiny_target", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_build_script_pure_parts(tiny):
    _, tokenizer = tiny
    script = build_script()
    assert script.repeated_ngram_fraction([1, 2, 3, 4, 5, 6], n=4) == 0.0
    assert script.repeated_ngram_fraction([7] * 10, n=4) == pytest.approx(1 - 1 / 7)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u\nv"}, {"role": "assistant", "content": "a"}]
    assert script.render(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert script.render(messages[:2], True) == tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    text = "\n".join(f"line {i}" for i in range(100))
    pieces = list(script.file_pieces("x.py", text, seed=0))
    assert "\n".join(p.prompt + "\n" + p.answer for p in pieces) == text  # consecutive, nothing lost
    assert [p.line for p in pieces] == sorted({p.line for p in pieces})


def test_token_stream_gives_the_sequential_ids_and_restores_the_parallelism_setting(tiny, monkeypatch):
    _, tokenizer = tiny
    script = build_script()
    documents = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 7) for i in range(300)]
    expected = [t for d in documents for t in tokenizer(d, add_special_tokens=False)["input_ids"]]
    for setting in ("false", None):
        if setting is None:
            monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        else:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", setting)
        assert script.token_stream(tokenizer, documents).tolist() == expected
        assert os.environ.get("TOKENIZERS_PARALLELISM") == setting


def test_eval_prompts_regenerate_identically_from_this_python(report):
    if sys.version.split()[0] != report["environment"]["python"] or sysconfig.get_paths()["stdlib"] != report["data"]["stdlib"]:
        pytest.skip("the prompt sets are a function of the stdlib of the Python that built them")
    script = build_script()
    files = [f for f in script.stdlib_files() if script.split_of(f[0]) == "eval"]
    assert len(files) == report["data"]["files_eval"]
    records = script.prompt_records(files, report["config"]["num_eval"], report["seed"], "eval")
    assert records == read_jsonl("tiny_prompts_eval.jsonl")
