"""Loss masks from chat templates: golden masks per template, the prefix-rendering rule, truncation."""

from __future__ import annotations

import json

import pytest

from eaglekit.data import Conversation, Message, parse_record, tokenize_conversation
from eaglekit.data.masking import TurnRender, assistant_spans, mask_from_offsets, trim_turn_end
from eaglekit.errors import EaglekitError
from test_data_support import CASES, GOLDEN, TEMPLATE_NAMES, TEMPLATES, build_chat_tokenizer, golden_record, learned_segments, template_text


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(template_text("llama3"))


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_golden_masks(name):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    assert golden_record(name) == expected


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_learned_text_is_exactly_the_assistant_turns(name):
    """Independent of the golden files: each learned segment is one assistant turn's text plus its end-of-turn token."""
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    end_of_turn = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "qwen3": "<|im_end|>", "deepseek": "<｜end▁of▁sentence｜>", "gemma": "<end_of_turn>"}[name]
    for case, messages in CASES.items():
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        learned = golden[case]["learned"]
        assert len(learned) == len(answers), case
        for segment, answer in zip(learned, answers):
            assert segment.endswith(answer + end_of_turn), (case, segment)
            assert not any(header in segment for header in ("<|start_header_id|>", "<|im_start|>", "<｜Assistant｜>", "<start_of_turn>", "<｜User｜>"))
    if name in ("deepseek", "qwen3"):  # the last turn's reasoning is learned, the dropped one is not in the text at all
        reasoning = golden["reasoning_two_turns"]
        assert reasoning["learned"][1].startswith("<think>\nThe user says thanks.\n</think>")
        assert "Let me think" not in reasoning["text"]


def test_mask_and_ids_aligned(tokenizer):
    record = tokenize_conversation(tokenizer, parse_record({"messages": CASES["system_two_turns"]}), max_length=None)
    assert len(record.input_ids) == len(record.loss_mask) == record.num_tokens == record.num_tokens_full
    assert not record.truncated and set(record.loss_mask) == {0, 1}
    assert tokenizer.decode(record.input_ids) == tokenizer.apply_chat_template(CASES["system_two_turns"], tokenize=False)


def test_truncation_keeps_mask_aligned(tokenizer):
    conversation = parse_record({"messages": CASES["system_two_turns"]})
    full = tokenize_conversation(tokenizer, conversation, max_length=None)
    cut = full.num_tokens - 5
    short = tokenize_conversation(tokenizer, conversation, max_length=cut)
    assert short.truncated and short.num_tokens == cut == len(short.input_ids) == len(short.loss_mask)
    assert short.num_tokens_full == full.num_tokens
    assert short.input_ids == full.input_ids[:cut] and short.loss_mask == full.loss_mask[:cut]
    same = tokenize_conversation(tokenizer, conversation, max_length=full.num_tokens)
    assert not same.truncated and same.loss_mask == full.loss_mask


def test_no_chat_template_is_a_clear_error():
    conversation = parse_record({"messages": CASES["single_turn"]})
    with pytest.raises(EaglekitError, match="no chat template; pass chat_template="):
        tokenize_conversation(build_chat_tokenizer(None), conversation, max_length=64)


def test_chat_template_from_file_and_string():
    conversation = parse_record({"messages": CASES["single_turn"]})
    bare = build_chat_tokenizer(None)
    from_file = tokenize_conversation(bare, conversation, None, chat_template=str(TEMPLATES / "chatml.jinja"))
    from_string = tokenize_conversation(bare, conversation, None, chat_template=template_text("chatml"))
    own = tokenize_conversation(build_chat_tokenizer(template_text("chatml")), conversation, None)
    assert from_file == from_string == own
    with pytest.raises(EaglekitError, match="neither a Jinja template nor an existing file"):
        tokenize_conversation(bare, conversation, None, chat_template="missing.jinja")


def test_template_exception_becomes_eaglekit_error():
    tokenizer = build_chat_tokenizer(template_text("gemma"))
    conversation = Conversation("x", (Message("user", "Hello!"), Message("user", "Hello again!")))
    with pytest.raises(EaglekitError, match="roles must alternate"):
        tokenize_conversation(tokenizer, conversation, None)


def test_generation_prompt_text_is_not_learned():
    """R1-style template whose generation prompt opens the think block: `<think>\\n` is prompt, the rest learned."""
    template = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}<｜Assistant｜><think>\n"
                "{{ m.reasoning_content }}\n</think>\n\n{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
    tokenizer = build_chat_tokenizer(template)
    conversation = Conversation("x", (Message("user", "Hello!"), Message("assistant", "Hi.", "The user says hello.")))
    record = tokenize_conversation(tokenizer, conversation, None)
    assert learned_segments(tokenizer, record.input_ids, record.loss_mask) == ["The user says hello.\n</think>\n\nHi.<｜end▁of▁sentence｜>"]


def test_rewritten_earlier_turn_is_matched_by_content():
    """Pure-string check of the rule for templates that change an earlier turn once later messages follow."""
    prompt1 = "<s>[U]Hi[A]"
    turn1 = "<s>[U]Hi[A]<t>why</t>Hello<e>"
    full = "<s>[U]Hi[A]Hello<e>[U]Bye[A]<t>because</t>Ciao<e>"
    prompt2 = "<s>[U]Hi[A]Hello<e>[U]Bye[A]"
    renders = [TurnRender(prompt1, turn1, "Hi", "Hello"), TurnRender(prompt2, full, "Bye", "Ciao")]
    spans = assistant_spans(full, renders)
    assert [full[s:e] for s, e in spans] == ["Hello<e>", "<t>because</t>Ciao<e>"]
    # the last turn ends with a different token than turns in context (gpt-oss: <|return|> vs <|end|>)
    turn1 = "<s>[U]Hi[A]<t>why</t>Hello<r>"
    full = "<s>[U]Hi[A]Hello<e>[U]Bye[A]Ciao<r>"
    renders = [TurnRender(prompt1, turn1, "Hi", "Hello"), TurnRender("<s>[U]Hi[A]Hello<e>[U]Bye[A]", full, "Bye", "Ciao")]
    spans = assistant_spans(full, renders, end_tokens=("<e>", "<r>"))
    assert [full[s:e] for s, e in spans] == ["Hello<e>", "Ciao<r>"]
    # a user message whose text also appears in the header does not confuse the start
    full = "[U]A[A]x<e>[U]A[A]y<e>"
    renders = [TurnRender("[U]A[A]", "[U]A[A]<t>1</t>x<e>", "A", "x"), TurnRender("[U]A[A]x<e>[U]A[A]", full, "A", "y")]
    assert [full[s:e] for s, e in assistant_spans(full, renders)] == ["x<e>", "y<e>"]


def test_trim_and_offsets():
    text = "A<end>\nB"
    assert trim_turn_end(text, (0, 7), ("<end>",)) == (0, 6)
    assert trim_turn_end(text, (0, 7), ()) == (0, 7)  # no end token: nothing trimmed
    # tokens: [0,1) [1,6) [6,7) [7,8); span [1,6) -> only token 2 learned; a token straddling a span edge is learned
    assert mask_from_offsets([(0, 1), (1, 6), (6, 7), (7, 8)], [(1, 6)]) == [0, 1, 0, 0]
    assert mask_from_offsets([(0, 2), (2, 4), (4, 8)], [(1, 3), (7, 8)]) == [1, 1, 1]


class _SlowView:
    """A tokenizer without offsets (like a slow/python tokenizer): the text is tokenised piece by piece."""

    is_fast = False

    def __init__(self, fast):
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)

    def __call__(self, text, **kwargs):
        kwargs.pop("return_offsets_mapping", None)
        return self._fast(text, **kwargs)


@pytest.mark.parametrize("name", ["llama3", "deepseek"])
def test_tokenizer_without_offsets_gives_the_same_mask(name):
    fast = build_chat_tokenizer(template_text(name))
    for messages in CASES.values():
        conversation = parse_record({"messages": messages})
        assert tokenize_conversation(_SlowView(fast), conversation, None) == tokenize_conversation(fast, conversation, None)


def test_assistant_first_and_consecutive_assistant_turns(tokenizer):
    conversation = Conversation("x", (Message("assistant", "Hello!"), Message("assistant", "Goodbye!")))
    record = tokenize_conversation(tokenizer, conversation, None)
    assert learned_segments(tokenizer, record.input_ids, record.loss_mask) == ["Hello!<|eot_id|>", "Goodbye!<|eot_id|>"]
