"""Choose the draft vocabulary: the N most frequent assistant tokens of the training data (d2t/t2d).

    eaglekit vocab target=PATH data=train.jsonl output=runs/vocab            # from conversations
    eaglekit vocab shards=runs/extract output=runs/vocab                     # from extract shards
    eaglekit vocab target=PATH data=new.jsonl init_from=DRAFTER output=...   # keeps the drafter's mapping

Writes `vocab.safetensors` (d2t offsets, t2d mask, counts), `config.yaml` and `manifest.json`, and prints
the coverage: the share of training (loss-masked) tokens that the draft vocabulary keeps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from eaglekit.config import option, save_resolved, to_dict
from eaglekit.errors import EaglekitError
from eaglekit.manifest import file_sha256, write_manifest

if TYPE_CHECKING:  # torch is imported by the functions that count, so `eaglekit vocab --help` stays fast
    import torch

    from eaglekit.training.vocab import VocabMapping

log = logging.getLogger(__name__)
POSITIONAL = ("data",)


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((), "conversation files (JSONL/JSON/HF dataset dirs) to count tokens in")
    skip_errors: bool = option(False, "skip malformed records of data (counted) instead of stopping")
    shards: str = option("", "an `extract` output directory to count tokens in (instead of data)")
    target: str = option("", "target model (path, hub id or 'tiny'): its tokenizer and vocabulary size")
    output: str = option("", "output directory for vocab.safetensors")
    # 32000 = eaglekit.training.vocab.DEFAULT_SIZE, written out to keep torch out of `--help` (tests/test_cli.py checks)
    size: int = option(32000, "draft vocabulary size N (the whole target vocabulary if smaller)", min=1)
    max_length: int = option(2048, "tokens per conversation (longer ones are truncated, as in training; 0 = no "
                                   "limit)", min=0)
    chat_template: str = option("", "chat template (Jinja text or .jinja file) overriding the tokenizer's")
    init_from: str = option("", "an existing eaglekit drafter: its mapping is kept (fine-tuning)")
    rebuild: bool = option(False, "with init_from: build a new mapping anyway (train then remaps lm_head rows)")
    trust_remote_code: bool = option(False, "allow the target's custom code")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by vocab")


def conversation_records(config: Config) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every conversation with assistant tokens, through the data layer and the target
    tokenizer."""
    from eaglekit.data import read_conversations, tokenize_conversations
    from eaglekit.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    tokenized = tokenize_conversations(tokenizer, conversations, config.max_length, config.chat_template or None,
                                       desc="vocab: tokenising")
    return ((record.input_ids, record.loss_mask) for record in tokenized.records)


def target_vocab_size(config: Config) -> int:
    from eaglekit.targets.capture import text_config
    from eaglekit.targets.loading import load_target_config

    target_config = load_target_config(config.target, trust_remote_code=config.trust_remote_code)
    return int(text_config(target_config).vocab_size)


def count(config: Config) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token counts (V,) from shards or conversations, and where they came from."""
    from eaglekit.training.vocab import count_tokens

    if bool(config.shards) == bool(config.data):
        raise EaglekitError("give exactly one source: data=FILES (conversations) or shards=DIR (extract output)")
    if config.shards:
        from eaglekit.training.data import shard_tokens
        from eaglekit.targets.store import HiddenStateDataset

        dataset = HiddenStateDataset(config.shards)
        vocab_size = int(dataset.manifest["vocab_size"])
        if config.target and target_vocab_size(config) != vocab_size:
            raise EaglekitError(f"shards in {config.shards} have vocab {vocab_size} but target {config.target} has "
                                f"{target_vocab_size(config)}: they come from another model")
        return count_tokens(shard_tokens(dataset), vocab_size), {"shards": config.shards,
                                                                 "target": dataset.manifest.get("target")}
    if not config.target:
        raise EaglekitError("counting conversations needs the target's tokenizer: pass target=PATH (or target=tiny)")
    return (count_tokens(conversation_records(config), target_vocab_size(config)),
            {"data": list(config.data), "target": config.target})


def choose(config: Config, counts: torch.Tensor) -> tuple[VocabMapping, str]:
    """The mapping to write: the init_from drafter's (kept) or the top-N of `counts` (built)."""
    from eaglekit.training.vocab import VocabMapping, mapping_from_drafter, select_vocab

    if config.init_from and not config.rebuild:
        from eaglekit.formats.saved import load_saved_drafter

        mapping = mapping_from_drafter(load_saved_drafter(config.init_from))
        if mapping.vocab_size != counts.numel():
            raise EaglekitError(f"drafter {config.init_from} targets a vocabulary of {mapping.vocab_size}, the data "
                                f"has {counts.numel()}: wrong drafter or target")
        return VocabMapping(mapping.used_ids, mapping.vocab_size, counts), f"kept from {config.init_from}"
    return select_vocab(counts, config.size), "built from counts"


def run(config: Config) -> dict[str, Any]:
    from eaglekit.training.vocab import VOCAB_FILE, save_vocab

    from eaglekit.manifest import claim_output

    if not config.output:
        raise EaglekitError("no output directory: pass output=DIR")
    output = claim_output(config.output, "vocab", config.overwrite)
    counts, source = count(config)
    if int(counts.sum()) == 0:
        raise EaglekitError("no loss-masked (assistant) tokens found in the data: prompts alone need answers, from "
                            "the target with `eaglekit regen PROMPTS output=DIR target=T` (then count "
                            "DIR/conversations.jsonl); else check the chat template / loss mask with "
                            "`eaglekit inspect`")
    mapping, how = choose(config, counts)
    path = save_vocab(output / VOCAB_FILE, mapping)
    coverage = mapping.coverage()
    seen = int((counts > 0).sum())
    result = {"path": str(path), "draft_vocab_size": int(mapping.used_ids.numel()), "vocab_size": mapping.vocab_size,
              "coverage": coverage, "tokens_counted": int(counts.sum()), "distinct_tokens": seen, "mapping": how}
    save_resolved(config, output)
    write_manifest(output, "vocab",
                   {"config": to_dict(config), "source": source, **result, "sha256": file_sha256(path)})
    print(f"draft vocabulary: {result['draft_vocab_size']} of {mapping.vocab_size} ids ({how}); "
          f"coverage {coverage:.2%} of {result['tokens_counted']} training tokens ({seen} distinct) -> {path}")
    return result
