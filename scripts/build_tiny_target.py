"""Build eaglekit's built-in tiny target from text that ships with Python itself.

    python scripts/build_tiny_target.py                 # ~5.5 minutes on 2 CPU cores
    python scripts/build_tiny_target.py --minutes 2 --output /tmp/tiny_rebuild

Trains, from scratch on the CPU, a small Llama-architecture chat model and its own byte-level BPE
tokenizer on the standard library's source (`sysconfig.get_paths()["stdlib"]`). The training data is
conversational: the user asks to continue a piece of stdlib code, the assistant answers with the true
continuation (plus some plain-text pieces). Files are split deterministically by a hash of their path
into train / prompts / eval; the prompts and eval files are never trained on. Writes into --output:

- `tiny_target/`: model + tokenizer (with a ChatML-like chat template) via `save_pretrained`, and
  `training_report.json` (held-out loss vs the uniform baseline ln(V), tokens, time, seed, versions,
  greedy samples with their repetition rate).
- `tiny_prompts.jsonl` (~200 OpenAI-`messages` records from held-out files) and
  `tiny_prompts_eval.jsonl` (~30 records from other held-out files, for benchmarks and the loss check).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from eaglekit.config import describe, load_config, option, to_dict  # noqa: E402
from eaglekit.errors import EaglekitError  # noqa: E402
from eaglekit.manifest import atomic_path, atomic_write_text, environment  # noqa: E402

log = logging.getLogger("build_tiny_target")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INSTRUCTIONS = (  # user-turn styles; the prompt sets use the first two
    "Continue this Python code:\n{code}",
    "Complete the following code from the Python standard library module `{module}`:\n{code}",
    "What comes next in this Python code?\n{code}",
    "Write the next lines of `{module}`:\n{code}",
)
SYSTEM_PROMPT = "You are a helpful assistant that writes Python code."
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
DEF_PREFIXES = ("def ", "class ", "async def ")


@dataclass(frozen=True)
class BuildConfig:
    output: str = option("src/eaglekit/assets", "directory that receives tiny_target/ and tiny_prompts*.jsonl")
    minutes: float = option(5.5, "wall-clock training budget in minutes")
    steps: int = option(0, "train exactly this many optimiser steps instead (reproducible on a busy machine); 0 = use minutes")
    seed: int = option(0, "seed for data order, initialisation and prompt selection")
    threads: int = option(2, "torch CPU threads")
    vocab_size: int = option(4096, "BPE vocabulary size (special tokens included)")
    hidden_size: int = option(128, "model width")
    num_layers: int = option(8, "decoder layers (8 gives EAGLE-3 aux layers 2, 4, 5)")
    num_heads: int = option(4, "attention heads")
    num_kv_heads: int = option(2, "key/value heads (grouped-query attention)")
    intermediate_size: int = option(384, "MLP width")
    max_positions: int = option(1024, "max_position_embeddings")
    seq_len: int = option(256, "training window in tokens")
    batch_size: int = option(4, "windows per optimiser step")
    lr: float = option(4e-3, "peak AdamW learning rate (cosine decay over the wall budget)")
    warmup_steps: int = option(20, "linear warm-up steps")
    num_prompts: int = option(200, "records in tiny_prompts.jsonl")
    num_eval: int = option(30, "records in tiny_prompts_eval.jsonl")
    dtype: str = option("bfloat16", "dtype of the saved weights", choices=("bfloat16", "float32"))
    device: str = option("cpu", "training device: cpu, cuda or auto (CUDA trains under bf16 autocast)")
    compile: bool = option(False, "torch.compile the training step (worth it on a GPU)")
    corpus: str = option("stdlib", "training text: the stdlib alone, or the stdlib plus installed site-packages",
                         choices=("stdlib", "stdlib+site-packages"))
    corpus_mb: float = option(0.0, "cap on the corpus size in MB, files taken in a fixed hashed order (0 = no cap)")
    name: str = option("tiny_target", "name of the model directory written under output")
    tokenizer: str = option("", "reuse this model directory's tokenizer instead of training one (a draft LM for a target)")


@dataclass(frozen=True)
class Piece:
    """A contiguous stretch of one stdlib file: `prompt` lines followed by `answer` lines."""
    file: str
    line: int  # 1-based line of the prompt's first line
    prompt: str
    answer: str


# ----------------------------------------------------------------------------------------------- data
def split_of(relative_path: str) -> str:
    """Deterministic file split by path hash: ~5% eval, ~5% prompts, the rest train."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 20
    return "eval" if bucket == 0 else "prompts" if bucket == 1 else "train"


def stdlib_files(corpus: str = "stdlib", corpus_mb: float = 0.0) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files (plus site-packages' with
    corpus="stdlib+site-packages"), tests and data tables left out; capped at `corpus_mb` in a fixed hashed order."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if corpus == "stdlib+site-packages":
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    files = [f for root in roots for f in _python_files(root)]
    if corpus_mb > 0:
        files.sort(key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
        kept, size = [], 0
        for relative, text in files:
            if size > corpus_mb * 1e6:
                break
            kept.append((relative, text))
            size += len(text)
        files = sorted(kept)
    if not files:
        raise EaglekitError(f"no Python sources under {', '.join(map(str, roots))}: run with a CPython that ships its Lib/ sources")
    return files


def _python_files(root: Path) -> list[tuple[str, str]]:
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[-1].startswith("test_"):
            continue
        if not 500 <= path.stat().st_size <= 300_000:
            continue
        try:
            files.append((relative, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return files


def _take_lines(lines: list[str], start: int, count: int, max_chars: int) -> list[str]:
    taken, chars = [], 0
    for line in lines[start:start + count]:
        line = line[:200]
        if taken and chars + len(line) > max_chars:
            break
        taken.append(line)
        chars += len(line) + 1
    return taken


def file_pieces(relative: str, text: str, seed: int) -> Iterator[Piece]:
    """Cut a whole file into consecutive (prompt, answer) pieces of random length."""
    rng = random.Random(f"{seed}:{relative}")
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        prompt = _take_lines(lines, i, rng.randint(2, 8), 400)
        answer = _take_lines(lines, i + len(prompt), rng.randint(3, 16), 600)
        start, i = i, i + len(prompt) + len(answer)
        if prompt and answer and "".join(prompt).strip() and "".join(answer).strip():
            yield Piece(relative, start + 1, "\n".join(prompt), "\n".join(answer))


def definition_pieces(relative: str, text: str, rng: random.Random) -> list[Piece]:
    """Pieces that start at a `def`/`class` line: the prompt set's candidates."""
    lines = text.splitlines()
    pieces = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(DEF_PREFIXES):
            prompt = _take_lines(lines, i, rng.randint(2, 5), 300)
            answer = _take_lines(lines, i + len(prompt), rng.randint(6, 14), 500)
            if answer and "".join(answer).strip():
                pieces.append(Piece(relative, i + 1, "\n".join(prompt), "\n".join(answer)))
    return pieces


def module_name(relative: str) -> str:
    return relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def piece_messages(piece: Piece, style: int, system: bool) -> list[dict[str, str]]:
    user = INSTRUCTIONS[style].format(code=piece.prompt, module=module_name(piece.file))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": piece.answer}]


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template, in Python, for the training stream (the tokenizer carries the Jinja one)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def training_documents(files: list[tuple[str, str]], seed: int) -> list[str]:
    """Every training piece once, shuffled: mostly chat conversations, some plain code."""
    pieces = [p for relative, text in files for p in file_pieces(relative, text, seed)]
    rng = random.Random(seed)
    rng.shuffle(pieces)
    documents = []
    for piece in pieces:
        if rng.random() < 0.15:
            documents.append(piece.prompt + "\n" + piece.answer + "\n" + ENDOFTEXT)
        else:
            style, system = rng.randrange(len(INSTRUCTIONS)), rng.random() < 0.2
            documents.append(render(piece_messages(piece, style, system)))
    return documents


def prompt_records(files: list[tuple[str, str]], count: int, seed: int, tag: str) -> list[dict[str, Any]]:
    """`count` OpenAI-messages records starting at definitions in held-out files, stable ids."""
    rng = random.Random(f"{seed}:{tag}")
    candidates = [p for relative, text in files for p in definition_pieces(relative, text, rng)]
    if len(candidates) < count:
        raise EaglekitError(f"only {len(candidates)} held-out definitions for {count} {tag} prompts: lower --num-{tag}")
    chosen = sorted(rng.sample(candidates, count), key=lambda p: (p.file, p.line))
    return [
        {"id": f"tiny-{tag}-{p.file}:{p.line}", "messages": piece_messages(p, style=i % 2, system=False)}
        for i, p in enumerate(chosen)
    ]


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(documents: list[str], vocab_size: int) -> Any:
    """Byte-level BPE with the chat special tokens, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer, length=len(documents))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=ENDOFTEXT, eos_token=IM_END, pad_token=ENDOFTEXT,
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@contextlib.contextmanager
def tokenizer_parallelism() -> Iterator[None]:
    """`encode_batch` on every core while inside (tokenizers reads the variable at each call). This module turns it
    off otherwise, so that processes forked later never inherit a used thread pool. Same ids either way; 120 MB took
    86 s on one core of the H200 machine, and 20 MB here 13.9 s on one core against 7.4 s on two."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def token_stream(tokenizer: Any, documents: list[str], limit: int = 0) -> torch.Tensor:
    """The documents tokenized back to back (stopping once `limit` tokens are there, if > 0). -> (N,) int64"""
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    batch = 2048 if not limit else 64
    with tokenizer_parallelism():
        for start in tqdm(range(0, len(documents), batch), desc="tokenize", unit="batch", mininterval=5):
            for encoding in backend.encode_batch(documents[start:start + batch], add_special_tokens=False):
                ids.extend(encoding.ids)
            if limit and len(ids) >= limit:
                break
    return torch.tensor(ids, dtype=torch.long)


def cached_stream(output: Path, tokenizer: Any, documents: list[str]) -> torch.Tensor:
    """`token_stream`, kept under output/.cache keyed by the tokenizer and the documents, so that a draft LM
    built with the target's tokenizer on the same corpus does not tokenize it again (120 MB: 86 s on one core)."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for document in documents:
        digest.update(hashlib.sha256(document.encode()).digest())
    path = output / ".cache" / f"stream-{digest.hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    stream = token_stream(tokenizer, documents)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(stream, tmp)
    return stream


# ----------------------------------------------------------------------------------------------- model
def build_model(config: BuildConfig, tokenizer: Any) -> Any:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(model_config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    return model


def learning_rate(config: BuildConfig, step: int, fraction: float) -> float:
    """Linear warm-up by step, then cosine decay to 10% over the budget (`fraction` done)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(fraction, 1.0))))


def train(config: BuildConfig, model: Any, stream: torch.Tensor) -> dict[str, Any]:
    """Train until the wall budget (or `steps`) is spent; windows are read from the stream in order (cycling)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95),
    )
    window = config.batch_size * (config.seq_len + 1)
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          "cpu" if config.device == "auto" else config.device)
    model.to(device)
    forward = torch.compile(model) if config.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    budget, start = config.minutes * 60.0, time.monotonic()
    step, position, tokens, recent = 0, 0, 0, []
    model.train()
    progress = tqdm(total=config.steps or int(budget), desc="train", unit="step" if config.steps else "s", mininterval=5)
    while (fraction := step / config.steps if config.steps else (time.monotonic() - start) / budget) < 1.0:
        if position + window > len(stream):
            position = 0
        batch = stream[position:position + window].view(config.batch_size, config.seq_len + 1).to(device)  # (B, T+1)
        position += window
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, fraction)
        with autocast:
            logits = forward(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + config.batch_size * config.seq_len
        recent = (recent + [loss.item()])[-20:]
        elapsed = time.monotonic() - start
        progress.update((step if config.steps else int(elapsed)) - progress.n)
        progress.set_postfix(step=step, loss=f"{sum(recent) / len(recent):.3f}", tok_s=f"{tokens / elapsed:.0f}")
    progress.close()
    model.to("cpu").eval()
    return {"steps": step, "tokens_seen": tokens, "train_seconds": round(time.monotonic() - start, 1),
            "train_loss_final": round(sum(recent) / max(len(recent), 1), 4), "stream_tokens": len(stream)}


# ------------------------------------------------------------------------------------------ evaluation
def assistant_labels(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and the indices of the last assistant turn's tokens.

    The answer starts where the tokens of the conversation first differ from those of the prompt
    rendered with `add_generation_prompt`; it ends at (and includes) the closing `<|im_end|>`.
    """
    prefix = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prefix_ids, ids)) if a != b), len(prefix_ids))
    end = len(ids) - 1 - ids[::-1].index(tokenizer.convert_tokens_to_ids(IM_END))
    return ids, list(range(start, end + 1))


@torch.no_grad()
def record_losses(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summed next-token loss (nats) over each record's assistant tokens."""
    out = []
    for record in records:
        ids, positions = assistant_labels(tokenizer, record["messages"])
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(ids)[positions]
        loss_sum = -log_probs[torch.tensor(positions) - 1, targets].sum().item()
        out.append({"id": record["id"], "tokens": len(positions), "loss_sum": round(loss_sum, 4)})
    return out


HELDOUT_WINDOWS = 48


@torch.no_grad()
def stream_loss(model: Any, stream: torch.Tensor, seq_len: int, max_windows: int = HELDOUT_WINDOWS) -> tuple[float, int]:
    """Mean next-token loss over consecutive windows of a held-out token stream."""
    total, count = 0.0, 0
    for start in range(0, min(len(stream) - seq_len - 1, max_windows * seq_len), seq_len):
        window = stream[start:start + seq_len + 1].unsqueeze(0)  # (1, T+1)
        logits = model(input_ids=window[:, :-1]).logits  # (1, T, V)
        total += torch.nn.functional.cross_entropy(logits[0].float(), window[0, 1:], reduction="sum").item()
        count += seq_len
    return total / max(count, 1), count


def repeated_ngram_fraction(ids: list[int], n: int = 4) -> float:
    """Share of the n-grams in `ids` that already occurred earlier (0 = no repetition, ->1 = a loop)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


@torch.no_grad()
def continuations(model: Any, tokenizer: Any, records: list[dict[str, Any]], new_tokens: int = 64,
                  temperature: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    """Continuations of the records' prompts: greedy (temperature 0), or sampled with a fixed seed."""
    samples = []
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    for record in records:
        prompt = tokenizer.apply_chat_template(record["messages"][:-1], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **sampling)
        generated = output[0, ids.shape[1]:].tolist()
        samples.append({
            "id": record["id"], "prompt": record["messages"][-2]["content"],
            "completion": tokenizer.decode(generated, skip_special_tokens=False),
            "tokens": len(generated), "repeated_4gram_fraction": round(repeated_ngram_fraction(generated), 3),
        })
    return samples


# ------------------------------------------------------------------------------------------------ main
def evaluate(directory: Path, config: BuildConfig, eval_records: list[dict[str, Any]], heldout_documents: list[str]) -> dict[str, Any]:
    """Measure the SAVED model exactly as users load it (`from_pretrained`, fp32 compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    baseline = math.log(len(tokenizer))
    per_record = record_losses(model, tokenizer, eval_records)
    eval_loss = sum(r["loss_sum"] for r in per_record) / sum(r["tokens"] for r in per_record)
    # stream_loss reads only the first windows: tokenize just enough of the held-out documents for them
    heldout = token_stream(tokenizer, heldout_documents, limit=(HELDOUT_WINDOWS + 1) * config.seq_len + 1)
    heldout_loss, heldout_tokens = stream_loss(model, heldout, config.seq_len)
    spread = eval_records[:: max(1, len(eval_records) // 6)][:6]  # spread over files
    samples = continuations(model, tokenizer, spread)
    sampled = continuations(model, tokenizer, spread[:3], temperature=1.0, seed=config.seed)
    return {
        "eval_loss": round(eval_loss, 4),
        "eval_loss_definition": "mean next-token loss (nats) over the assistant tokens (answer + <|im_end|>) of tiny_prompts_eval.jsonl",
        "heldout_loss": round(heldout_loss, 4),
        "heldout_tokens": heldout_tokens,
        "heldout_loss_definition": "mean next-token loss over all tokens of chat-formatted pieces of held-out stdlib files",
        "baseline_uniform": round(baseline, 4),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "repetition_rate": round(sum(s["repeated_4gram_fraction"] for s in samples) / len(samples), 3),
        "repetition_rate_definition": "mean share of repeated 4-grams in 64-token greedy continuations of eval prompts",
        "eval_records": per_record,
        "samples": samples,
        "sampled_samples": sampled,
        "sampled_samples_definition": "64-token continuations at temperature 1 (no top-k/top-p), torch seed = the build seed",
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def install(staging: Path, target: Path) -> None:
    """Replace `target` by the finished `staging` directory (no half-written model is ever in place)."""
    if target.exists():
        old = target.with_name(f".{target.name}.old{os.getpid()}")
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old)
    else:
        staging.rename(target)


def build(config: BuildConfig) -> dict[str, Any]:
    started = time.monotonic()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    files = stdlib_files(config.corpus, config.corpus_mb)
    split = {name: [f for f in files if split_of(f[0]) == name] for name in ("train", "prompts", "eval")}
    log.info("stdlib: %d files (%d train, %d prompts, %d eval)", len(files), *(len(v) for v in split.values()))
    documents = training_documents(split["train"], config.seed)
    heldout_documents = training_documents(split["prompts"] + split["eval"], config.seed)
    if config.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    else:
        tokenizer = train_tokenizer(documents, config.vocab_size)
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert tokenizer.apply_chat_template(probe, tokenize=False) == render(probe), "Jinja and Python templates differ"
    stream = cached_stream(Path(config.output), tokenizer, documents)
    log.info("tokenizer: %d tokens; training stream: %d tokens", len(tokenizer), len(stream))
    prompts = prompt_records(split["prompts"], config.num_prompts, config.seed, "prompts")
    eval_records = prompt_records(split["eval"], config.num_eval, config.seed, "eval")
    model = build_model(config, tokenizer)
    training = train(config, model, stream)

    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    staging = output / f".tiny_target.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.to(getattr(torch, config.dtype)).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    report = {**evaluate(staging, config, eval_records, heldout_documents), **training}
    report.update({
        "seed": config.seed, "dtype": config.dtype, "total_seconds": round(time.monotonic() - started, 1),
        "data": {"stdlib": sysconfig.get_paths()["stdlib"], **{f"files_{k}": len(v) for k, v in split.items()},
                 "files_sha256": hashlib.sha256("\n".join(f for f, _ in files).encode()).hexdigest()[:16]},
        "config": to_dict(config), "environment": environment(),
        "size_bytes": sum(p.stat().st_size for p in staging.iterdir()),
    })
    atomic_write_text(staging / "training_report.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    install(staging, output / config.name)
    write_jsonl(output / "tiny_prompts.jsonl", prompts)
    write_jsonl(output / "tiny_prompts_eval.jsonl", eval_records)
    return report


def parse_args(argv: list[str] | None) -> BuildConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, type_name, default, help_text in describe(BuildConfig):
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, default=None, metavar=type_name.upper(),
                            help=f"{help_text} [default: {default}]")
    values = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    return load_config(BuildConfig, None, values)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = parse_args(argv)
        report = build(config)
    except EaglekitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"held-out loss {report['heldout_loss']:.3f} (eval prompts' answers {report['eval_loss']:.3f}) "
          f"vs uniform baseline ln(V) = {report['baseline_uniform']:.3f}; {report['tokens_seen']:,} tokens in "
          f"{report['train_seconds']:.0f}s; greedy repetition rate {report['repetition_rate']:.2f}")
    for sample in report["samples"][:2]:
        print(f"--- {sample['id']}\n{sample['prompt']}\n>>> {sample['completion']}")
    print(f"wrote {Path(config.output) / config.name} ({report['size_bytes'] / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
