"""A streamed answer's text: equal to the full decode on tokenizers that split characters over tokens (byte-level
BPE with merges, SentencePiece-style byte fallback), at every length a generation may stop at, and each token
decoded once (the whole answer is decoded once, at its end)."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from eaglekit.generation.backends import EngineOutput
from eaglekit.generation.server import ChatServer
from eaglekit.generation.server_text import TextStream

CORPUS = ["naïve café — Grüße, 東京タワー 🚀🧪 emoji 👩‍👩‍👧 mixed ünïcödé text", "déjà vu: 数据 ✓ ok 😀 😀😀",
          "plain words on the road"] * 20
TEXT = "naïve café 東京タワー 🚀🧪 👩‍👩‍👧 words déjà vu: 数据 ✓ on the road 😀😀"


def byte_level() -> Tokenizer:
    """GPT-2 style: bytes as characters, merges learnt across the bytes of one character."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    return tokenizer


def byte_fallback() -> Tokenizer:
    """Llama-2 style: '▁' word starts, unknown characters as <0xNN> byte tokens, the first space stripped."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(["déjà vu plain words naïve on the road"] * 5,
                                  trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>"]))
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    vocab.update({f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)})
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(data))


class SlowTokenizer:
    """A tokenizer without a `tokenizers` backend (the windowed path); counts the token ids it decodes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.decoded_ids = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingFast(SlowTokenizer):
    """A transformers-like tokenizer over a fast backend; counts its full decodes."""

    @property
    def backend_tokenizer(self):
        return self.tokenizer


def streamed(tokenizer, ids: list[int], chunk: int) -> str:
    text = TextStream(tokenizer)
    pieces = [text.step(ids[start:start + chunk]) for start in range(0, len(ids), chunk)]
    return "".join(pieces) + text.finish(ids)


def whole_characters(tokenizer: Tokenizer, ids: list[int]) -> int:
    """How many of `ids` end at a character boundary (the longest prefix that decodes without U+FFFD)."""
    return max(end for end in range(len(ids) + 1) if "\ufffd" not in tokenizer.decode(ids[:end]))


@pytest.mark.parametrize("make", [byte_level, byte_fallback])
def test_streamed_text_equals_the_full_decode_at_every_length(make):
    """Ended at a character boundary: the full decode. Ended inside a character (a length limit), the fast path:
    every whole character, and no more than the full decode shows (byte fallback turns a whole run of byte tokens
    into U+FFFD when its last character is cut)."""
    tokenizer = make()
    ids = tokenizer.encode(TEXT).ids
    assert tokenizer.decode(ids) == TEXT
    split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert len(split) >= 8, "the text must split characters over tokens"
    for wrap in (lambda t: t, SlowTokenizer):
        for end in range(len(ids) + 1):
            full, whole = tokenizer.decode(ids[:end]), tokenizer.decode(ids[:whole_characters(tokenizer, ids[:end])])
            for chunk in (1, 3):  # one token a step (plain decoding), several (a speculative step's accepted run)
                text = streamed(wrap(tokenizer), ids[:end], chunk)
                if "\ufffd" not in full:
                    assert text == full, (wrap, end, chunk)
                elif wrap is not SlowTokenizer:  # the windowed path keeps only what its window decodes
                    assert text.startswith(whole) and len(text) <= len(full), (end, chunk)


def test_no_piece_of_a_stream_holds_half_a_character():
    tokenizer = byte_fallback()
    text = TextStream(tokenizer)
    pieces = [text.step([token]) for token in tokenizer.encode(TEXT).ids]
    assert all("\ufffd" not in piece for piece in pieces) and "".join(pieces) == TEXT


def test_a_stream_decodes_each_token_once():
    """n tokens streamed: the fast path decodes the whole answer once (at its end), the windowed path O(n) ids."""
    tokenizer = byte_level()
    ids = (tokenizer.encode(TEXT).ids * 40)[:2000]
    fast = CountingFast(tokenizer)
    assert streamed(fast, ids, 1) == tokenizer.decode(ids) and fast.decoded_ids == len(ids)
    slow = SlowTokenizer(tokenizer)
    assert streamed(slow, ids, 1) == tokenizer.decode(ids)
    assert slow.decoded_ids < 12 * len(ids)  # re-decoding the whole answer per token would be ~n^2 / 2 = 2,000,000


class TokenizerEngine:
    """An engine that 'generates' the tokens of TEXT one at a time, through a real tokenizer."""

    max_context = None

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = CountingFast(tokenizer)
        self.ids = tokenizer.encode(TEXT).ids

    def encode_chat(self, messages):
        return [1, 2, 3]

    def decode(self, ids):
        return self.tokenizer.decode(ids)

    def text_stream(self):
        return TextStream(self.tokenizer)

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, on_tokens=None):
        ids = self.ids[:max_new_tokens]
        for token in ids:
            if on_tokens is not None:
                on_tokens([token])
        return EngineOutput(ids, "length")

    def metrics(self):
        return {}


def test_served_stream_equals_the_answer():
    tokenizer = byte_fallback()
    engine = TokenizerEngine(tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(engine.ids), "temperature": 0}
    with ChatServer(engine, "fake", port=0) as server, httpx.Client(timeout=30) as client:
        url = server.url + "/v1/chat/completions"
        whole = client.post(url, json=body).json()["choices"][0]["message"]["content"]
        engine.tokenizer.decoded_ids = 0
        with client.stream("POST", url, json={**body, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole == TEXT
    assert engine.tokenizer.decoded_ids == len(engine.ids)  # one full decode, at the end
