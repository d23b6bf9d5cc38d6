"""Where the assistant turns are in a rendered chat template: pure string functions, no tokenizer.

The rule (docs/data.md): for assistant message k, the template is rendered twice more,
`prompt` = messages[:k] with the generation prompt and `turn` = messages[:k+1]. The turn's learned text
starts where those two renders part (the generation prompt, e.g. `<|start_header_id|>assistant<|end_header_id|>\n\n`,
is prompt) and ends at the end of `turn` (the end-of-turn token is learned).

When `turn` is a prefix of the full rendering the span is read off directly. When it is not, the template
rewrote this turn because later messages followed (typically: it drops the reasoning of earlier turns).
The turn is then matched in the form it takes in the full rendering: it starts after the previous
message's text and the header both renders share, and ends after this message's content and the text the
template puts after it (its end-of-turn token; where that differs in context, as gpt-oss's final-turn
`<|return|>` does, the special token that follows the content there). Whatever the template kept of the turn in between
(reasoning or not) is learned, since that is what the target sees in context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class SpanError(ValueError):
    """The assistant turn cannot be located in the full rendering."""


@dataclass(frozen=True)
class TurnRender:
    prompt: str  # messages[:k] rendered with the generation prompt
    turn: str  # messages[:k+1] rendered
    previous: str | None  # stripped text of message k-1 when it is a non-empty system/user message
    content: str  # stripped content of message k


def common_prefix_length(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _turn_start(full: str, render: TurnRender, start_of_turn: int, cursor: int) -> int:
    """Where a rewritten turn's learned text starts in `full`: after the previous message and the header."""
    if render.previous is None:
        raise SpanError("the template renders it differently once later messages follow, and the message before it is "
                        "not a user/system message with text")
    in_prompt = render.turn.rfind(render.previous, 0, start_of_turn)
    if in_prompt < 0:
        raise SpanError("the text of the message before it is not rendered verbatim")
    # previous message's text + the turn's header, e.g. "Hi<|im_end|>\n<|im_start|>assistant\n"
    anchor = render.turn[in_prompt:start_of_turn]
    at = full.find(anchor, cursor)
    if at >= 0:
        return at + len(anchor)
    found = full.find(render.previous, cursor)  # the header changed too: keep the part both renders share
    if found < 0:
        raise SpanError("the text of the message before it is not rendered verbatim")
    after_previous = found + len(render.previous)
    return after_previous + common_prefix_length(full[after_previous:], anchor[len(render.previous) :])


def _turn_end(full: str, render: TurnRender, start_of_turn: int, start: int, end_tokens: tuple[str, ...]) -> int:
    """Where a rewritten turn ends in `full`: after its content and the text the template writes after it."""
    if render.content:
        at = render.turn.rfind(render.content)
        if at < start_of_turn:
            raise SpanError("its content is not rendered verbatim")
        tail = render.turn[at + len(render.content) :]
    else:
        tail = render.turn[start_of_turn:]
    for candidate in (render.content + tail, render.content + tail.rstrip()):
        at = full.find(candidate, start)
        if at >= 0 and candidate:
            return at + len(candidate)
    at = full.find(render.content, start) if render.content else -1
    if at >= 0:  # the end-of-turn token differs in context (e.g. a final-turn token): take the one that follows
        end = at + len(render.content)
        following = [token for token in end_tokens if token and full.startswith(token, end)]
        return end + max(map(len, following), default=0)
    raise SpanError("its content and end-of-turn text do not appear in the full rendering")


def assistant_spans(full: str, renders: list[TurnRender], end_tokens: tuple[str, ...] = ()) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn in `full`, in order, not overlapping."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, render in enumerate(renders):
        start_of_turn = common_prefix_length(render.prompt, render.turn)
        if full.startswith(render.turn) and start_of_turn >= cursor:
            span = (start_of_turn, len(render.turn))
        else:
            try:
                start = _turn_start(full, render, start_of_turn, cursor)
                span = (start, _turn_end(full, render, start_of_turn, start, end_tokens))
            except SpanError as error:
                raise SpanError(f"assistant turn {index + 1}: {error}") from None
        assert cursor <= span[0] <= span[1] <= len(full), (cursor, span)
        spans.append(span)
        cursor = span[1]
    return spans


def trim_turn_end(full: str, span: tuple[int, int], end_tokens: tuple[str, ...]) -> tuple[int, int]:
    """Drop whitespace the template writes after the end-of-turn token (`<|im_end|>\\n`: the `\\n` is scaffolding)."""
    start, end = span
    stripped = full[start:end].rstrip()
    if len(stripped) < end - start and stripped.endswith(end_tokens):
        return start, start + len(stripped)
    return span


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters [s, e) overlap a span, else 0. Both lists sorted by position."""
    mask = [0] * len(offsets)
    span_index = 0
    for i, (s, e) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= s:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] < e and s < spans[span_index][1]:
            mask[i] = 1
    return mask
