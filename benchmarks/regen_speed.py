"""`regen --backend hf` throughput against plain `model.generate` on the same prompts and batches.

    python benchmarks/regen_speed.py --smoke                       # CPU, tiny random model, seconds
    python benchmarks/regen_speed.py --shape 8b --batch-size 16    # GPU: 8B-shaped random Llama, bf16
    python benchmarks/regen_speed.py --target /models/Llama-3.1-8B-Instruct

Both sides generate greedily from the same chat-templated prompts, `batch_size` at a time, with the
same `max_new_tokens` and eos; figures are completion tokens per second (tokens up to and
excluding eos), medians of `--repeats` timed runs after one untimed pass over the same batches. The regen side is the
whole stage (`eaglekit.stages.regen.run`: reading, templating, batching, fsynced JSONL writes),
timed from its own stats (model loading excluded). A random model rarely emits eos, so both sides
usually run the full `max_new_tokens`. With `--shape`, the model is a random Llama of that shape
using a small byte-level tokenizer (ids the tokenizer lacks decode to nothing; counts are unaffected).
Writes JSON (hardware, commit, config, figures) to `--out` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 4, 4, 2, None),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}
TOPICS = ["the quick brown fox", "two plus two", "a lazy dog", "hello world", "python code", "the weather today"]


def build_random_target(directory: Path, shape: str) -> str:
    """A random Llama of `shape` plus a small byte-level BPE tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(TOPICS * 8, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|end|>", "<|pad|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                        pad_token="<|pad|>", chat_template=template)
    tokenizer.save_pretrained(directory)
    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if shape != "tiny" else torch.float32)
    model = model.to_empty(device="cpu")  # no fp32 copy of an 8B model; RoPE buffers are rebuilt on load
    for parameter in model.parameters():  # random weights, small enough to keep activations finite
        torch.nn.init.normal_(parameter, std=0.02)
    model.save_pretrained(directory)
    return str(directory)


def write_prompts(path: Path, count: int, words: int) -> None:
    with open(path, "w") as handle:
        for index in range(count):
            text = " ".join(TOPICS[(index + k) % len(TOPICS)] for k in range(max(1, words // 3)))
            handle.write(json.dumps({"id": f"p{index}", "messages": [{"role": "user", "content": f"{index}: {text}"}]}) + "\n")


def plain_generate(backend, prompts_path: Path, batch_size: int, max_new_tokens: int) -> tuple[float, int]:
    """Seconds and completion tokens for bare `model.generate` (tokenizer left padding) over the same batches."""
    from eaglekit.data import read_conversations

    model, tokenizer = backend.model, backend.tokenizer
    tokenizer.padding_side = "left"
    conversations = read_conversations(str(prompts_path))
    texts = [tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in c.messages],
                                           add_generation_prompt=True, tokenize=False) for c in conversations]
    texts.sort(key=len)  # regen batches by similar length too
    batches = [tokenizer(texts[i: i + batch_size], add_special_tokens=False, padding=True, return_tensors="pt")
               for i in range(0, len(texts), batch_size)]
    eos = torch.tensor(backend.eos_ids)
    _sync(backend.device)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        with torch.inference_mode():
            out = model.generate(**batch.to(backend.device), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=backend.eos_ids, pad_token_id=backend.pad_id)
        new = out[:, batch["input_ids"].shape[1]:].cpu()  # (B, new)
        is_eos = torch.isin(new, eos)
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(new),), new.shape[1]))
        tokens += int(first_eos.sum())
    _sync(backend.device)
    return time.perf_counter() - start, tokens


def regen_stage(target: str, prompts_path: Path, out_dir: Path, args: argparse.Namespace) -> tuple[float, int]:
    from eaglekit.stages import regen

    result = regen.run(regen.Config(data=(str(prompts_path),), output=str(out_dir), target=target,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                    device=args.device, dtype=args.dtype))
    return result.stats["seconds"], result.stats["completion_tokens"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="", help="model directory (default: a random model of --shape)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, a few seconds")
    parser.add_argument("--out", default="", help="JSON path (default runs/benchmarks/regen_speed.json; "
                        "--smoke: regen_speed_smoke.json in the temporary directory)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.records, args.batch_size, args.max_new_tokens, args.repeats = "tiny", 8, 4, 8, 2
        args.prompt_words, args.device = 12, "cpu"
    args.out = args.out or (str(Path(tempfile.gettempdir()) / "regen_speed_smoke.json") if args.smoke
                            else "runs/benchmarks/regen_speed.json")

    from eaglekit.manifest import atomic_write_json, environment
    from eaglekit.generation.backends import HFBackend

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target = args.target or build_random_target(work / "target", args.shape)
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, args.records, args.prompt_words)
        backend = HFBackend.load(target, args.device, args.dtype)
        # one whole untimed pass: a short warm-up left the first timed plain pass at a quarter of the speed
        # of the next (kernels and allocator still cold for these batch shapes)
        plain_generate(backend, prompts, args.batch_size, args.max_new_tokens)
        plain, staged = [], []
        for repeat in range(args.repeats):
            seconds, tokens = plain_generate(backend, prompts, args.batch_size, args.max_new_tokens)
            plain.append(tokens / seconds)
            seconds, tokens = regen_stage(target, prompts, work / f"regen{repeat}", args)
            staged.append(tokens / seconds)
    result = {
        "benchmark": "regen_speed", "environment": environment(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "plain_generate_tokens_per_second": round(statistics.median(plain), 2),
        "regen_tokens_per_second": round(statistics.median(staged), 2),
        "regen_over_plain": round(statistics.median(staged) / statistics.median(plain), 3),
        "runs": {"plain": [round(x, 2) for x in plain], "regen": [round(x, 2) for x in staged]},
    }
    atomic_write_json(args.out, result)
    print("| side | completion tokens/s |\n|---|---|")
    print(f"| plain model.generate | {result['plain_generate_tokens_per_second']} |")
    print(f"| eaglekit regen (hf) | {result['regen_tokens_per_second']} ({result['regen_over_plain']:.2f}x) |")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
