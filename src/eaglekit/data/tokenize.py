"""Tokenising conversations with the target's own chat template, and the loss mask of assistant tokens.

`tokenize_conversation` renders the whole conversation with the chat template, finds the character
spans of the assistant turns by rendering prefixes (`eaglekit.data.masking`, no `{% generation %}`
needed), tokenises the full text once and marks each token that overlaps an assistant span. Reasoning
is given to the template as `reasoning_content` (the name Qwen3, DeepSeek and Kimi templates read) and
as `thinking` (gpt-oss).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eaglekit.data.conversation import Conversation
from eaglekit.data.masking import SpanError, TurnRender, assistant_spans, mask_from_offsets, trim_turn_end
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizedRecord:
    id: str
    input_ids: list[int]  # (T,) after truncation
    loss_mask: list[int]  # (T,) 1 = an assistant token the drafter learns to predict
    num_tokens: int  # T, after truncation
    truncated: bool  # the rendered conversation was longer than max_length
    num_tokens_full: int = 0  # tokens before truncation

    @property
    def num_learned(self) -> int:
        return sum(self.loss_mask)


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The Jinja template to use: `chat_template` (a Jinja string or a .jinja file), else the tokenizer's own."""
    if chat_template:
        if "{{" in chat_template or "{%" in chat_template:
            return chat_template
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise EaglekitError(f"chat_template {chat_template!r} is neither a Jinja template nor an existing file; "
                                "pass the path of a .jinja file")
        return path.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise EaglekitError(f"the tokenizer of {name} has no chat template; pass chat_template=FILE.jinja "
                            "(the Jinja chat template the model was trained with)")
    return template


def template_messages(conversation: Conversation) -> list[dict[str, str]]:
    """Messages as chat templates expect them; reasoning goes in `reasoning_content` and `thinking`."""
    out = []
    for message in conversation.messages:
        item = {"role": message.role, "content": message.content}
        if message.reasoning is not None:  # the names templates read: Qwen3/DeepSeek/Kimi, and gpt-oss
            item["reasoning_content"] = message.reasoning
            item["thinking"] = message.reasoning
        out.append(item)
    return out


def prompt_messages(conversation: Conversation) -> list[dict[str, str]]:
    """The conversation up to (not including) its last assistant turn, as `template_messages` gives it:
    the prompt a generation answers."""
    messages = template_messages(conversation)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise EaglekitError(f"conversation {conversation.id} has no user turn to use as a prompt")
    return messages


def render(tokenizer: Any, messages: list[dict[str, str]], template: str, add_generation_prompt: bool = False) -> str:
    """The chat template applied to `messages`, as text (special tokens written out)."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, TypeError, ValueError) as error:
        roles = "/".join(m["role"] for m in messages)
        raise EaglekitError(f"the chat template failed on a conversation with roles {roles}: {error}; "
                            "fix the data (e.g. roles the template does not allow) or pass "
                            "chat_template=FILE.jinja") from None
    assert isinstance(text, str), type(text)
    return text


@functools.lru_cache(maxsize=8)
def _warn_once(message: str) -> None:
    log.warning(message)


def _turn_renders(tokenizer: Any, conversation: Conversation, template: str) -> list[TurnRender]:
    messages = template_messages(conversation)
    renders = []
    for k, message in enumerate(conversation.messages):
        if message.role != "assistant":
            continue
        turn = render(tokenizer, messages[: k + 1], template)
        if message.reasoning and message.reasoning.strip() not in turn:
            _warn_once("the chat template does not render `reasoning_content`; reasoning in the data is not learned "
                       "(pass chat_template=FILE.jinja with a template that renders it)")
        previous = conversation.messages[k - 1] if k else None
        previous_text = (previous.content.strip() if previous and previous.role != "assistant"
                         and previous.content.strip() else None)
        content = message.content.strip()
        if k:
            prompt = render(tokenizer, messages[:k], template, True)
        # an assistant message opens the conversation (templates cannot
        # render zero messages): learned from its content on
        else:
            prompt = turn[: turn.find(content)] if content and content in turn else ""
        renders.append(TurnRender(prompt, turn, previous_text, content))
    return renders


def _end_tokens(tokenizer: Any) -> tuple[str, ...]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return tuple(token.content for token in added.values()) + tuple(getattr(tokenizer, "all_special_tokens", ()))


def _tokens_and_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenise the full text once (offsets from a fast tokenizer); slow tokenizers: piece by piece."""
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), mask_from_offsets(list(encoded["offset_mapping"]), spans)
    ids: list[int] = []
    mask: list[int] = []
    cuts = [0] + [p for span in spans for p in span] + [len(text)]
    for i in range(len(cuts) - 1):
        piece = tokenizer(text[cuts[i] : cuts[i + 1]],
                          add_special_tokens=False)["input_ids"] if cuts[i + 1] > cuts[i] else []
        ids.extend(piece)
        mask.extend([i % 2] * len(piece))  # odd pieces are the spans
    return ids, mask


def tokenize_conversation(tokenizer: Any, conversation: Conversation, max_length: int | None,
                          chat_template: str | None = None) -> TokenizedRecord:
    """Token ids of the rendered conversation and the loss mask (1 on assistant turns), truncated to `max_length`."""
    template = resolve_chat_template(tokenizer, chat_template)
    messages = template_messages(conversation)
    full = render(tokenizer, messages, template)
    end_tokens = _end_tokens(tokenizer)
    try:
        spans = assistant_spans(full, _turn_renders(tokenizer, conversation, template), end_tokens)
    except SpanError as error:
        raise EaglekitError(f"conversation {conversation.id}: cannot find the {error}; pass chat_template=FILE.jinja "
                            "with a template that renders earlier turns unchanged, or remove this record") from None
    spans = [trim_turn_end(full, span, end_tokens) for span in spans]
    input_ids, loss_mask = _tokens_and_mask(tokenizer, full, spans)
    full_length = len(input_ids)
    truncated = max_length is not None and max_length > 0 and full_length > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedRecord(conversation.id, input_ids, loss_mask, len(input_ids), truncated, full_length)


@dataclass
class TokenizedSet:
    """The learnable records of a conversation set (each with an assistant token, ids unique) and counts of the rest."""

    records: list[TokenizedRecord]
    read: int  # conversations given
    truncated: int  # records cut at max_length (kept)
    no_assistant_tokens: int  # records dropped: nothing to learn from
    duplicates: int  # records dropped: an id seen before

    def stats(self) -> dict[str, int]:
        return {"records_read": self.read, "truncated": self.truncated,
                "no_assistant_tokens": self.no_assistant_tokens, "duplicates": self.duplicates}


def tokenize_conversations(tokenizer: Any, conversations: list[Conversation], max_length: int | None,
                           chat_template: str | None = None, desc: str = "tokenise") -> TokenizedSet:
    """`tokenize_conversation` over a set, with a progress bar; keeps the records a drafter can learn from and
    warns when some were truncated."""
    records: dict[str, TokenizedRecord] = {}
    truncated = empty = duplicates = 0
    for conversation in tqdm(conversations, desc=desc, unit="conv", leave=False, disable=None):
        record = tokenize_conversation(tokenizer, conversation, max_length, chat_template)
        truncated += int(record.truncated)
        if record.id in records:
            duplicates += 1
        elif not any(record.loss_mask):
            empty += 1
        else:
            records[record.id] = record
    if truncated:
        log.warning("%d of %d records were longer than max_length=%d and were truncated", truncated,
                    len(conversations), max_length)
    return TokenizedSet(list(records.values()), len(conversations), truncated, empty, duplicates)
