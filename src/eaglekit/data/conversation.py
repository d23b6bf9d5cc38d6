"""Conversations: the `Message`/`Conversation` types, the record formats people really have, stable ids.

A record (one JSON object) is turned into a `Conversation` by `parse_record`. Accepted formats:

- OpenAI: `{"messages": [{"role", "content", "reasoning_content"?}, ...]}`; `content` may also be a
  list of `{"type": "text", "text": ...}` parts; `reasoning` and `thinking` are accepted as
  names of the reasoning field; role `developer` counts as `system`.
- ShareGPT: `{"conversations": [{"from", "value"}, ...]}` with `from` in human/user, gpt/assistant/
  model/chatgpt, system (a `{"role", "content"}` message inside `conversations` is accepted too).
- Plain: `{"prompt": ..., "completion": ...}` (completion optional, so prompt-only data can be
  regenerated), optional `system` and `reasoning`.

Any format may carry a top-level `system` string (prepended when the messages have no system turn)
and an `id`. The id is the record's own `id`, else `content_id(messages)`: a hash of the messages'
roles, text and reasoning, the same on every run and wherever the record sits in its file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class RecordError(ValueError):
    """A record that cannot be read as a conversation; the reader adds the file and line."""


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str
    reasoning: str | None = None  # assistant reasoning (a think block), learned like the content


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]


def content_id(messages: tuple[Message, ...]) -> str:
    """A 16-hex-digit id from the messages alone (roles, content, reasoning)."""
    canonical = json.dumps([[m.role, m.content, m.reasoning] for m in messages], ensure_ascii=False,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _text(value: Any, what: str) -> str:
    """A message's text: a string, or OpenAI content parts whose text parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RecordError(f"{what} has a non-text content part ({kind}); only text conversations are supported")
        return "".join(texts)
    if value is None:
        raise RecordError(f"{what} has no content")
    raise RecordError(f"{what} content must be a string, not {type(value).__name__}")


def _message(raw: Any, index: int) -> Message:
    what = f"message {index}"
    if not isinstance(raw, dict):
        raise RecordError(f"{what} must be an object, not {type(raw).__name__}")
    if "role" in raw or "content" in raw:
        role_raw, content = raw.get("role"), raw.get("content")
    elif "from" in raw or "value" in raw:
        role_raw, content = raw.get("from"), raw.get("value")
    else:
        raise RecordError(f"{what} has neither role/content nor from/value keys (keys: "
                          f"{', '.join(map(str, raw)) or 'none'})")
    role = ROLE_ALIASES.get(str(role_raw).lower()) if role_raw is not None else None
    if role is None:
        raise RecordError(f"{what} has role {role_raw!r}; supported: {', '.join(sorted(ROLE_ALIASES))}")
    reasoning = next((raw[k] for k in REASONING_KEYS if raw.get(k) not in (None, "")), None)
    if reasoning is not None:
        if role != "assistant":
            raise RecordError(f"{what} is a {role} message with reasoning; only assistant messages may carry reasoning")
        reasoning = _text(reasoning, f"{what} reasoning")
    return Message(role, _text(content, what), reasoning)


def _messages(record: dict[str, Any]) -> list[Message]:
    if "messages" in record or "conversations" in record:
        key = "messages" if "messages" in record else "conversations"
        raw = record[key]
        if not isinstance(raw, list) or not raw:
            raise RecordError(f"'{key}' must be a non-empty list of messages")
        return [_message(m, i) for i, m in enumerate(raw)]
    if "prompt" in record:
        messages = [Message("user", _text(record["prompt"], "prompt"))]
        if record.get("completion") is not None:
            reasoning = record.get("reasoning")
            reasoning = _text(reasoning, "reasoning") if reasoning not in (None, "") else None
            messages.append(Message("assistant", _text(record["completion"], "completion"), reasoning))
        return messages
    keys = ", ".join(map(str, record)) or "none"
    raise RecordError(f"unknown record format (keys: {keys}); expected 'messages' (OpenAI), 'conversations' (ShareGPT) "
                      "or 'prompt'/'completion'")


def parse_record(record: Any) -> Conversation:
    """One JSON object -> a `Conversation`, or `RecordError` saying what is wrong with it."""
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, not {type(record).__name__}")
    messages = _messages(record)
    system = record.get("system")
    if system not in (None, "") and all(m.role != "system" for m in messages):
        messages.insert(0, Message("system", _text(system, "system")))
    own_id = record.get("id")
    if own_id is not None and (isinstance(own_id, bool) or not isinstance(own_id, (str, int))):
        raise RecordError(f"'id' must be a string or an integer, not {type(own_id).__name__}")
    if own_id is not None and str(own_id).strip() == "":
        raise RecordError("'id' is empty; remove it to use a content hash, or give a non-empty id")
    frozen = tuple(messages)
    return Conversation(str(own_id) if own_id is not None else content_id(frozen), frozen)
