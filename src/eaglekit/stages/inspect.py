"""Show what the drafter will learn from: token counts and the loss-masked text of each conversation.

    eaglekit inspect data.jsonl --target DIR [--max_length 2048] [--limit 20] [--chat_template FILE.jinja]

Each record is rendered with the target tokenizer's chat template exactly as `extract` will; the tokens
the drafter learns to predict (assistant turns, with their end-of-turn token) are shown between ⟦ and ⟧.
Everything outside the markers is prompt: the target sees it, the drafter is not trained on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eaglekit.config import check_options, option, save_resolved
from eaglekit.errors import EaglekitError

POSITIONAL = ("data",)
OPEN, CLOSE = "⟦", "⟧"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((), "conversation data: .jsonl/.json files or Hugging Face dataset "
                                       "directories (comma-separated)")
    target: str = option("tiny", "target model directory or hub id whose tokenizer and chat template are "
                                 "used ('tiny' = built-in)")
    max_length: int = option(2048, "tokens kept per conversation; longer ones are truncated (0 = no limit)", min=0)
    limit: int = option(20, "conversations to inspect, from the start of the data (0 = all)", min=0)
    show_text: bool = option(True, "print each conversation's text with the learned tokens marked ⟦...⟧")
    chat_template: str = option("", "a Jinja chat template (file path or string) used instead of the tokenizer's own")
    skip_errors: bool = option(False, "skip malformed records (counted) instead of stopping at the first")
    trust_remote_code: bool = option(False, "allow the target's own tokenizer code to run")
    output: str = option("", "also write per-record counts and totals to this JSON file (the resolved "
                             "config goes beside it)")


def marked_text(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> str:
    """The decoded tokens with each run of learned tokens wrapped in ⟦ ⟧."""
    pieces, start = [], 0
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or loss_mask[i] != loss_mask[start]:
            text = tokenizer.decode(input_ids[start:i])
            pieces.append(f"{OPEN}{text}{CLOSE}" if loss_mask[start] else text)
            start = i
    return "".join(pieces)


def _record_line(index: int, total: int, record: Any, max_length: int) -> str:
    kept = (f"truncated: kept {record.num_tokens} of {record.num_tokens_full} (max_length={max_length})"
            if record.truncated else "not truncated")
    return f"[{index}/{total}] id={record.id}  tokens={record.num_tokens}  learned={record.num_learned}  {kept}"


def _summary(rows: list[dict[str, Any]], read_total: int, skipped: int, max_length: int) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in rows)
    learned = sum(r["learned"] for r in rows)
    return {
        "records": len(rows),
        "records_read": read_total,
        "skipped": skipped,
        "tokens": tokens,
        "learned_tokens": learned,
        "learned_fraction": learned / tokens if tokens else 0.0,
        "truncated": sum(r["truncated"] for r in rows),
        "no_learned_tokens": sum(r["learned"] == 0 for r in rows),
        "max_length": max_length,
    }


def _print_summary(totals: dict[str, Any]) -> None:
    shown = totals["records"]
    of = f" (the first {shown} of {totals['records_read']})" if shown < totals["records_read"] else ""
    print(f"\n{shown} conversations{of}: {totals['tokens']} tokens, {totals['learned_tokens']} learned "
          f"({100 * totals['learned_fraction']:.1f}%), {totals['truncated']} truncated at "
          f"max_length={totals['max_length']}, {totals['no_learned_tokens']} with nothing to learn, "
          f"{totals['skipped']} malformed skipped")


def run(config: Config) -> dict[str, Any]:
    from eaglekit.data import load_conversations, tokenize_conversation
    from eaglekit.targets.loading import load_tokenizer

    if not config.data:
        raise EaglekitError("no data given: eaglekit inspect FILE.jsonl --target DIR")
    check_options(config)  # each option within its declared range (the CLI's load_config checked them already)
    if config.output:
        from eaglekit.manifest import check_output_file

        check_output_file(config.output, "inspect.json")
    read = load_conversations(list(config.data), skip_errors=config.skip_errors)
    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    chosen = read.conversations[: config.limit] if config.limit else read.conversations
    max_length = config.max_length or None
    rows = []
    for index, conversation in enumerate(tqdm(chosen, desc="tokenizing", unit=" conversations", disable=None,
                                              leave=False), 1):
        record = tokenize_conversation(tokenizer, conversation, max_length, config.chat_template or None)
        print(_record_line(index, len(chosen), record, config.max_length))
        if config.show_text:
            print(marked_text(tokenizer, record.input_ids, record.loss_mask) + "\n")
        rows.append({"id": record.id, "tokens": record.num_tokens, "tokens_before_truncation": record.num_tokens_full,
                     "learned": record.num_learned, "truncated": record.truncated})
    totals = _summary(rows, len(read.conversations), read.skipped, config.max_length)
    _print_summary(totals)
    if config.output:
        from eaglekit.manifest import atomic_write_json

        output = Path(config.output)
        atomic_write_json(output, {"totals": totals, "records": rows, "skipped_errors": read.errors})
        save_resolved(config, output.parent, f"{output.stem}.config.yaml")
        log.info("wrote %s", output)
    return {"totals": totals, "records": rows}
