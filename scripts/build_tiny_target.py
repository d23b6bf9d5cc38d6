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
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eaglekit.config import describe, load_config, to_dict  # noqa: E402
from eaglekit.errors import EaglekitError  # noqa: E402
from eaglekit.manifest import atomic_directory, atomic_write_text, environment  # noqa: E402

log = logging.getLogger("build_tiny_target")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when loaded by file path
from tiny_target_data import (  # noqa: E402,F401  (split_of, file_pieces, render, token_stream: for the tests)
    cached_stream, file_pieces, prompt_records, render, split_of, stdlib_files, token_stream, train_tokenizer,
    training_documents)
from tiny_target_config import BuildConfig  # noqa: E402
from tiny_target_training import build_model, evaluate, repeated_ngram_fraction, train  # noqa: E402,F401


# ------------------------------------------------------------------------------------------------ main
def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


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
    with atomic_directory(output / config.name) as staging:  # no half-written model is ever in place
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
