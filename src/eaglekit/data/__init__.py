"""The conversation data layer: read records in the formats people have, tokenise them with the
target's chat template and mark the assistant tokens the drafter learns from (docs/data.md)."""

from eaglekit.data.conversation import Conversation, Message, content_id, parse_record
from eaglekit.data.readers import ReadResult, load_conversations, read_conversations
from eaglekit.data.tokenize import (
    TokenizedRecord,
    TokenizedSet,
    prompt_messages,
    render,
    resolve_chat_template,
    template_messages,
    tokenize_conversation,
    tokenize_conversations,
)

__all__ = [
    "Conversation",
    "Message",
    "ReadResult",
    "TokenizedRecord",
    "TokenizedSet",
    "content_id",
    "load_conversations",
    "parse_record",
    "prompt_messages",
    "read_conversations",
    "render",
    "resolve_chat_template",
    "template_messages",
    "tokenize_conversation",
    "tokenize_conversations",
]
