"""Regenerate and capture in one vLLM run (`eaglekit extract backend=vllm regenerate=true`): per record, a generation
request (nothing saved) answers its prompt, eaglekit tokenises the answered conversation as `extract` would, and a
capture request of that record follows; vLLM's prefix cache holds the generation's states, so the capture request
recomputes only the chat template's tail after the answer (end of turn, newline). The store is what `regen` +
`extract` would write; the answered conversations go to `regenerated.jsonl` (the stage writes them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from eaglekit.errors import EaglekitError
from eaglekit.vllm.capture import CaptureCounters, EngineLayers, EngineSession, engine_error, store_file

if TYPE_CHECKING:
    from eaglekit.targets.extract import Record
    from eaglekit.targets.shard_writer import ShardWriter
    from eaglekit.targets.store import StoreLayout


@dataclass(frozen=True)
class Regeneration:
    """How answers are generated, and how a record is made from one (as `extract` tokenises a conversation)."""

    tokenizer: Any
    chat_template: str
    max_length: int
    max_new_tokens: int
    temperature: float
    seed: int
    eos_ids: tuple[int, ...]
    context: int  # the engine's max_model_len: a prompt's answer is cut to what leaves room for the template's tail


TEMPLATE_TAIL = 16  # tokens a chat template may add after an answer (end of turn, newline)


def prompt_of(conversation: Any) -> Any:
    """The conversation without its last assistant turn(s): what the target answers."""
    from eaglekit.data import Conversation

    messages = list(conversation.messages)
    while messages and messages[-1].role == "assistant":
        messages.pop()
    return Conversation(conversation.id, tuple(messages))


def prompt_ids(regeneration: Regeneration, prompt: Any) -> list[int]:
    """Token ids of the prompt with the assistant's opening, as `regen backend=hf` encodes it."""
    from eaglekit.data.tokenize import render, template_messages

    text = render(regeneration.tokenizer, template_messages(prompt), regeneration.chat_template, True)
    return list(regeneration.tokenizer(text, add_special_tokens=False)["input_ids"])


def answered(regeneration: Regeneration, prompt: Any, output: list[int]) -> tuple[Any, str]:
    """The conversation with the generated answer (cut at the first end-of-sequence id), and the finish reason."""
    from eaglekit.data import Conversation, Message

    cut = next((i for i, token in enumerate(output) if token in regeneration.eos_ids), None)
    ids = output if cut is None else output[:cut]
    text = regeneration.tokenizer.decode(ids, skip_special_tokens=True)
    reason = "stop" if cut is not None else "length"
    return Conversation(prompt.id, (*prompt.messages, Message("assistant", text))), reason


@dataclass(frozen=True)
class Answer:
    """A generated answer as it is stored: the answered conversation, its record, and how the answer ended."""

    conversation: Any
    tokenized: Any  # eaglekit.data.TokenizedRecord of `conversation`
    reason: str  # "stop" | "length"
    dropped: int  # answer tokens cut so that the record fits the engine's context


def fitting_answer(regeneration: Regeneration, prompt: Any, output: list[int]) -> Answer:
    """The answered conversation and the record `tokenize_conversation` makes of it; when the record and the
    capture's one sampled token do not fit the engine's context, the answer is cut to its longest prefix whose
    record does (finish reason "length").

    The record is the answered text re-tokenised, as `regen` + `extract` store it, not the generated ids; decoded
    text may re-encode to more tokens than were generated (a token that is part of a UTF-8 character decodes to
    U+FFFD, which can take three tokens), which the template's tail allowance does not always cover.
    """
    from eaglekit.data import tokenize_conversation

    def make(ids: list[int]) -> tuple[Any, str, Any]:
        conversation, reason = answered(regeneration, prompt, ids)
        tokenized = tokenize_conversation(regeneration.tokenizer, conversation, regeneration.max_length,
                                          regeneration.chat_template or None)
        return conversation, reason, tokenized

    def fits(tokenized: Any) -> bool:
        return len(tokenized.input_ids) + 1 <= regeneration.context

    conversation, reason, tokenized = make(output)
    ids = output[: next((i for i, token in enumerate(output) if token in regeneration.eos_ids), len(output))]
    kept = len(ids)
    if not fits(tokenized):  # the longest answer prefix whose record fits (bisection)
        low, high = 0, len(ids) - 1
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(make(ids[:middle])[2]) else (low, middle - 1)
        kept = low
        conversation, _, tokenized = make(ids[:kept])
        reason = "length"
    if not fits(tokenized):
        raise EaglekitError(f"record {prompt.id} has {len(tokenized.input_ids)} tokens without its answer, more "
                            f"than vLLM's {regeneration.context}-token context holds (the chat template adds more "
                            f"than {TEMPLATE_TAIL} tokens after an answer); pass vllm_engine_args='{{\"max_model_len"
                            f"\": {len(tokenized.input_ids) + 1 + regeneration.max_new_tokens}}}'")
    return Answer(conversation, tokenized, reason, len(ids) - kept)


def conversation_line(conversation: Any, meta: dict[str, Any]) -> dict[str, Any]:
    from eaglekit.data.tokenize import template_messages

    messages = [{k: v for k, v in m.items() if k != "thinking"} for m in template_messages(conversation)]
    return {"id": conversation.id, "messages": messages, "regen": meta}


def regenerate_records(session: EngineSession, conversations: list[Any], regeneration: Regeneration,
                       layers: EngineLayers, norm: Any, layout: StoreLayout, writer: ShardWriter, window: int,
                       on_stored: Callable[[Record, dict[str, Any]], None]) -> CaptureCounters:
    """For each conversation: a generation request (nothing saved), then a capture request of the record that
    `tokenize_conversation` makes from the answered conversation (request ids 2i and 2i + 1)."""
    import torch

    from eaglekit.targets.extract import Record
    from eaglekit.generation.regen import record_seed

    counters = CaptureCounters()
    prompts = [prompt_of(c) for c in conversations]
    records: dict[int, tuple[Record, dict[str, Any]]] = {}
    state = {"sent": 0, "finished": 0}

    def send_more() -> None:
        while state["sent"] < len(prompts) and state["sent"] - state["finished"] < window:
            i = state["sent"]
            ids = prompt_ids(regeneration, prompts[i])
            budget = min(regeneration.max_new_tokens, regeneration.context - TEMPLATE_TAIL - len(ids))
            if budget < 1:
                raise EaglekitError(f"the prompt of record {prompts[i].id} has {len(ids)} tokens and leaves no room "
                                    f"for an answer in the engine's {regeneration.context}-token context")
            session.send({"id": 2 * i, "prompt": ids, "max_tokens": budget, "temperature": regeneration.temperature,
                          "seed": record_seed(regeneration.seed, prompts[i].id), "stop": list(regeneration.eos_ids),
                          "save": False})
            state["sent"] += 1
        if state["sent"] == len(prompts) and state["finished"] == len(prompts):
            session.send({"end": True})

    def finish() -> None:
        state["finished"] += 1
        send_more()

    send_more()
    for event in session.events():
        i, capture = divmod(event["id"], 2)
        if "error" in event:
            advice = engine_error(event["error"], session.target, session.engine)
            raise EaglekitError(f"vLLM refused record {prompts[i].id}: {advice}")
        if not capture:
            answer = fitting_answer(regeneration, prompts[i], event["output"])
            counters.generated_tokens += len(event["output"])
            counters.finish_reasons[answer.reason] = counters.finish_reasons.get(answer.reason, 0) + 1
            counters.answers_cut += answer.dropped > 0
            tokenized = answer.tokenized
            if not any(tokenized.loss_mask):  # an empty answer: nothing to learn, as extract skips it
                finish()
                continue
            record = Record(answer.conversation.id, torch.tensor(tokenized.input_ids, dtype=torch.long),
                            torch.tensor(tokenized.loss_mask, dtype=torch.uint8))
            meta = {"backend": "vllm", "finish_reason": answer.reason, "completion_tokens": len(event["output"])}
            if answer.dropped:
                meta["tokens_cut_to_fit_context"] = answer.dropped
            records[i] = (record, conversation_line(answer.conversation, meta))
            session.send({"id": 2 * i + 1, "prompt": tokenized.input_ids, "max_tokens": 1, "save": True})
            continue
        record, line = records.pop(i)
        store_file(event["file"], record, layers, norm, layout, writer)
        counters.records += 1
        counters.tokens += len(record.input_ids)
        on_stored(record, line)
        finish()
    counters.seconds = time.perf_counter() - session.ready_at
    counters.engine_startup_seconds = session.ready.get("startup_seconds", 0.0)
    return counters
