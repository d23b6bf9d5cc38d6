"""The text of a streamed completion as its tokens arrive: each token decoded once, no character lost or split.

A fast tokenizer (a `tokenizers.Tokenizer`, or a transformers tokenizer wrapping one) streams through the tokenizers
library's own incremental decoder, `tokenizers.decoders.DecodeStream` (what vLLM streams with): it holds back the
bytes of a character split over several tokens and the text a later token may still change (merges, a word's
leading space). A tokenizer without one decodes a short window of recent tokens per step (the prefix/read offsets
that vLLM and TGI use for slow tokenizers), so a generation of n tokens costs O(n) either way.
"""

from __future__ import annotations

import contextlib
from typing import Any


class TextStream:
    """`step(new_ids) -> text` gives the text those tokens add (possibly ""); `finish(all_ids)` what remains of
    `decode(all_ids)` once the generation has ended (a character its last tokens left incomplete)."""

    def __init__(self, tokenizer: Any, lock: Any = None):
        self.tokenizer = tokenizer
        self.lock = lock or contextlib.nullcontext()  # fast tokenizers are not safe to call from several threads
        self.backend = _fast_tokenizer(tokenizer)
        self.ids: list[int] = []
        self.sent = ""
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.prefix_offset = self.read_offset = 0  # the window of the slow-tokenizer path

    def step(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        with self.lock:
            if self.backend is not None:
                pieces = [self.stream.step(self.backend, token) for token in new_ids]
                text = "".join(piece for piece in pieces if piece)
            else:
                text = self._window_step()
        self.sent += text
        return text

    def _window_step(self) -> str:
        """The text the tokens after `read_offset` add, decoded with the few tokens before them as context."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        current = self._decode(self.ids[self.prefix_offset:])
        if len(current) <= len(prefix) or current.endswith("\ufffd"):
            return ""  # nothing new yet, or a character whose bytes are still arriving
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return current[len(prefix):]

    def finish(self, ids: list[int]) -> str:
        """The rest of `decode(ids)` after what was streamed (one full decode per generation)."""
        with self.lock:
            full = self._decode(ids)
        rest = full[len(self.sent):] if full.startswith(self.sent) else ""
        self.sent += rest
        return rest

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _fast_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind `tokenizer` (itself, or a transformers tokenizer's backend), else None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None
