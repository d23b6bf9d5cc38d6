"""The tiny target's model: built (a small Llama), trained on the token stream within a wall budget, and measured
as users load it (held-out loss, per-record loss of the eval prompts, greedy and sampled continuations), for
scripts/build_tiny_target.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tiny_target_config import BuildConfig
from tiny_target_data import ENDOFTEXT, IM_END, token_stream

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
