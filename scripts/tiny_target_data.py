"""The tiny target's training text and prompts, cut from the Python standard library's source, and its tokenizer
(byte-level BPE with the chat special tokens), for scripts/build_tiny_target.py.

Files are split deterministically by a hash of their path into train / prompts / eval (`split_of`); the prompts
and eval files are never trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INSTRUCTIONS = (  # user-turn styles; the prompt sets use the first two
    "Continue this Python code:\n{code}",
    "Complete the following code from the Python standard library module `{module}`:\n{code}",
    "What comes next in this Python code?\n{code}",
    "Write the next lines of `{module}`:\n{code}",
)
SYSTEM_PROMPT = "You are a helpful assistant that writes Python code."
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
DEF_PREFIXES = ("def ", "class ", "async def ")



@dataclass(frozen=True)
class Piece:
    """A contiguous stretch of one stdlib file: `prompt` lines followed by `answer` lines."""
    file: str
    line: int  # 1-based line of the prompt's first line
    prompt: str
    answer: str


# ----------------------------------------------------------------------------------------------- data
def split_of(relative_path: str) -> str:
    """Deterministic file split by path hash: ~5% eval, ~5% prompts, the rest train."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 20
    return "eval" if bucket == 0 else "prompts" if bucket == 1 else "train"


def stdlib_files(corpus: str = "stdlib", corpus_mb: float = 0.0) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files (plus site-packages' with
    corpus="stdlib+site-packages"), tests and data tables left out; capped at `corpus_mb` in a fixed hashed order."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if corpus == "stdlib+site-packages":
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    files = [f for root in roots for f in _python_files(root)]
    if corpus_mb > 0:
        files.sort(key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
        kept, size = [], 0
        for relative, text in files:
            if size > corpus_mb * 1e6:
                break
            kept.append((relative, text))
            size += len(text)
        files = sorted(kept)
    if not files:
        raise EaglekitError(f"no Python sources under {', '.join(map(str, roots))}: run with a CPython that ships its Lib/ sources")
    return files


def _python_files(root: Path) -> list[tuple[str, str]]:
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[-1].startswith("test_"):
            continue
        if not 500 <= path.stat().st_size <= 300_000:
            continue
        try:
            files.append((relative, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return files


def _take_lines(lines: list[str], start: int, count: int, max_chars: int) -> list[str]:
    taken, chars = [], 0
    for line in lines[start:start + count]:
        line = line[:200]
        if taken and chars + len(line) > max_chars:
            break
        taken.append(line)
        chars += len(line) + 1
    return taken


def file_pieces(relative: str, text: str, seed: int) -> Iterator[Piece]:
    """Cut a whole file into consecutive (prompt, answer) pieces of random length."""
    rng = random.Random(f"{seed}:{relative}")
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        prompt = _take_lines(lines, i, rng.randint(2, 8), 400)
        answer = _take_lines(lines, i + len(prompt), rng.randint(3, 16), 600)
        start, i = i, i + len(prompt) + len(answer)
        if prompt and answer and "".join(prompt).strip() and "".join(answer).strip():
            yield Piece(relative, start + 1, "\n".join(prompt), "\n".join(answer))


def definition_pieces(relative: str, text: str, rng: random.Random) -> list[Piece]:
    """Pieces that start at a `def`/`class` line: the prompt set's candidates."""
    lines = text.splitlines()
    pieces = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(DEF_PREFIXES):
            prompt = _take_lines(lines, i, rng.randint(2, 5), 300)
            answer = _take_lines(lines, i + len(prompt), rng.randint(6, 14), 500)
            if answer and "".join(answer).strip():
                pieces.append(Piece(relative, i + 1, "\n".join(prompt), "\n".join(answer)))
    return pieces


def module_name(relative: str) -> str:
    return relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def piece_messages(piece: Piece, style: int, system: bool) -> list[dict[str, str]]:
    user = INSTRUCTIONS[style].format(code=piece.prompt, module=module_name(piece.file))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": piece.answer}]


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template, in Python, for the training stream (the tokenizer carries the Jinja one)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def training_documents(files: list[tuple[str, str]], seed: int) -> list[str]:
    """Every training piece once, shuffled: mostly chat conversations, some plain code."""
    pieces = [p for relative, text in files for p in file_pieces(relative, text, seed)]
    rng = random.Random(seed)
    rng.shuffle(pieces)
    documents = []
    for piece in pieces:
        if rng.random() < 0.15:
            documents.append(piece.prompt + "\n" + piece.answer + "\n" + ENDOFTEXT)
        else:
            style, system = rng.randrange(len(INSTRUCTIONS)), rng.random() < 0.2
            documents.append(render(piece_messages(piece, style, system)))
    return documents


def prompt_records(files: list[tuple[str, str]], count: int, seed: int, tag: str) -> list[dict[str, Any]]:
    """`count` OpenAI-messages records starting at definitions in held-out files, stable ids."""
    rng = random.Random(f"{seed}:{tag}")
    candidates = [p for relative, text in files for p in definition_pieces(relative, text, rng)]
    if len(candidates) < count:
        raise EaglekitError(f"only {len(candidates)} held-out definitions for {count} {tag} prompts: lower --num-{tag}")
    chosen = sorted(rng.sample(candidates, count), key=lambda p: (p.file, p.line))
    return [
        {"id": f"tiny-{tag}-{p.file}:{p.line}", "messages": piece_messages(p, style=i % 2, system=False)}
        for i, p in enumerate(chosen)
    ]


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(documents: list[str], vocab_size: int) -> Any:
    """Byte-level BPE with the chat special tokens, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer, length=len(documents))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=ENDOFTEXT, eos_token=IM_END, pad_token=ENDOFTEXT,
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@contextlib.contextmanager
def tokenizer_parallelism() -> Iterator[None]:
    """`encode_batch` on every core while inside (tokenizers reads the variable at each call). The build script turns
    it off otherwise, so that processes forked later never inherit a used thread pool. Same ids either way; 120 MB took
    86 s on one core of an H200 host, and 20 MB on a 2-core CPU 13.9 s on one core against 7.4 s on two."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def token_stream(tokenizer: Any, documents: list[str], limit: int = 0) -> torch.Tensor:
    """The documents tokenized back to back (stopping once `limit` tokens are there, if > 0). -> (N,) int64"""
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    batch = 2048 if not limit else 64
    with tokenizer_parallelism():
        for start in tqdm(range(0, len(documents), batch), desc="tokenize", unit="batch", mininterval=5):
            for encoding in backend.encode_batch(documents[start:start + batch], add_special_tokens=False):
                ids.extend(encoding.ids)
            if limit and len(ids) >= limit:
                break
    return torch.tensor(ids, dtype=torch.long)


def cached_stream(output: Path, tokenizer: Any, documents: list[str]) -> torch.Tensor:
    """`token_stream`, kept under output/.cache keyed by the tokenizer and the documents, so that a draft LM
    built with the target's tokenizer on the same corpus does not tokenize it again (120 MB: 86 s on one core)."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for document in documents:
        digest.update(hashlib.sha256(document.encode()).digest())
    path = output / ".cache" / f"stream-{digest.hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    stream = token_stream(tokenizer, documents)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(stream, tmp)
    return stream
