"""Reading conversation records from JSONL/JSON files and local Hugging Face `datasets` directories.

Every record is located for error messages: `file.jsonl:12` (line of the record), `file.json:40` (line
where the record starts), `dir[train][row 7]` (a `datasets` row). With `skip_errors=False` the first bad
record stops the read with an `EaglekitError` naming it; with `skip_errors=True` bad records are
skipped, counted and logged.

Duplicate ids: a record identical to an earlier one (same id, same messages) is kept and its id gets a
suffix `#2`, `#3`, ... (so repeated examples keep their weight and ids stay unique); a record that reuses
an earlier record's explicit `id` for different messages is an error (a malformed record).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from tqdm import tqdm

from eaglekit.data.conversation import Conversation, RecordError, parse_record
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASET_SUFFIXES = (".parquet", ".arrow", ".csv")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
# names every stage's data/prompts option takes for the prompt files shipped with eaglekit
SHIPPED_DATA = {"tiny": ASSETS / "tiny_prompts.jsonl", "tiny-eval": ASSETS / "tiny_prompts_eval.jsonl"}


@dataclass
class ReadResult:
    conversations: list[Conversation]
    skipped: int = 0  # malformed records skipped (skip_errors=True)
    errors: list[str] = field(default_factory=list)  # "where: what", one per skipped record


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record or RecordError) for each non-blank line."""
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, RecordError(f"not UTF-8 text ({error.reason} at byte {error.start})")
                continue
            line = line.lstrip("\ufeff").strip()
            if not line:
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, RecordError(f"not valid JSON: {error.msg} at column {error.colno}")


def _json_array_items(text: str) -> Iterator[tuple[int, Any]]:
    """(line number where it starts, value) for each element of a valid top-level JSON array."""
    decoder = json.JSONDecoder()
    index, line = text.index("[") + 1, 1 + text.count("\n", 0, text.index("["))
    while True:
        while text[index] in " \t\r\n,":
            line += text[index] == "\n"
            index += 1
        if text[index] == "]":
            return
        value, end = decoder.raw_decode(text, index)
        yield line, value
        line += text.count("\n", index, end)
        index = end


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise EaglekitError(f"{path} is not UTF-8 text ({error.reason}); re-save it as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several objects, one per line: JSON Lines named .json
            yield from _jsonl_records(path)
            return
        raise EaglekitError(f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno}); "
                            "no record after this point can be read, so fix the file") from None
    if isinstance(data, list):
        for line, value in _json_array_items(text):
            yield f"{path}:{line}", value
    elif isinstance(data, dict):
        yield f"{path}:1", data
    else:
        raise EaglekitError(f"{path} holds a JSON {type(data).__name__}; expected a list of records "
                            "or one record object")


def _dataset_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a `save_to_disk` directory, a directory of data files, or one parquet/arrow/csv file."""
    from eaglekit.extras import require

    datasets = require("datasets", f"reading {path} (a Hugging Face dataset)")
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            builder = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}[path.suffix]
            loaded = datasets.load_dataset(builder, data_files=str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        raise EaglekitError(f"cannot read {path} as a Hugging Face dataset: {error}") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        split = "train" if "train" in loaded else names[0] if len(names) == 1 else None
        if split is None:
            raise EaglekitError(f"{path} has splits {', '.join(names)} and none is 'train'; save the "
                                "split to use on its own (dataset[split].save_to_disk(DIR)) and pass that directory")
        loaded, where = loaded[split], f"{path}[{split}]"
    else:
        where = str(path)
    for row_index, row in enumerate(loaded):
        yield f"{where}[row {row_index}]", row


def _expand(path: Path) -> list[Path]:
    """A directory of JSON(L) files only -> those files; anything else is read as it is."""
    if not path.is_dir() or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if files and all(p.suffix in JSON_SUFFIXES for p in files):
        return files
    if not files:
        raise EaglekitError(f"data directory {path} is empty")
    return [path]


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.exists():
        raise EaglekitError(f"data path {path} does not exist; pass a .jsonl/.json file or a dataset directory")
    if path.is_dir() or path.suffix in DATASET_SUFFIXES:
        return _dataset_rows(path)
    if path.suffix == ".json":
        return _json_records(path)
    return _jsonl_records(path)  # .jsonl, .ndjson and anything else: one JSON object per line


def _as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    result = [SHIPPED_DATA.get(str(p), Path(p).expanduser()) for p in paths if str(p).strip()]
    if not result:
        raise EaglekitError("no data given: pass data=FILE (a .jsonl/.json file or a dataset directory)")
    return result


class _Collector:
    """Parses records, makes ids unique and applies the skip_errors policy."""

    def __init__(self, skip_errors: bool) -> None:
        self.skip_errors = skip_errors
        self.result = ReadResult([])
        self.first_seen: dict[str, tuple[str, Conversation]] = {}  # base id -> (where, conversation)
        self.copies: dict[str, int] = {}

    def add(self, where: str, record: Any) -> None:
        try:
            if isinstance(record, RecordError):
                raise record
            conversation = self._unique(where, parse_record(record))
        except RecordError as error:
            if not self.skip_errors:
                raise EaglekitError(f"{where}: {error}; fix or remove this record, or set "
                                    "skip_errors=true to skip bad records") from None
            self.result.skipped += 1
            self.result.errors.append(f"{where}: {error}")
            log.warning("skipping %s: %s", where, error)
            return
        self.result.conversations.append(conversation)

    def _unique(self, where: str, conversation: Conversation) -> Conversation:
        seen = self.first_seen.get(conversation.id)
        if seen is None:
            self.first_seen[conversation.id] = (where, conversation)
            return conversation
        if seen[1].messages != conversation.messages:
            raise RecordError(f"id {conversation.id!r} is already used by {seen[0]} for a different "
                              "conversation; ids must be unique")
        self.copies[conversation.id] = self.copies.get(conversation.id, 1) + 1
        return Conversation(f"{conversation.id}#{self.copies[conversation.id]}", conversation.messages)


def load_conversations(paths: str | Path | Sequence[str | Path], skip_errors: bool = False) -> ReadResult:
    """Conversations from every path in order, with the count and list of skipped malformed records."""
    collector = _Collector(skip_errors)
    for path in _as_paths(paths):
        for file in _expand(path):
            records: Iterable[tuple[str, Any]] = _records(file)
            for where, record in tqdm(records, desc=f"reading {file.name}", unit=" records", leave=False, disable=None):
                collector.add(where, record)
    result = collector.result
    if result.skipped:
        log.warning("skipped %d malformed record(s) of %d", result.skipped, result.skipped + len(result.conversations))
    if collector.copies:
        log.info("%d record(s) repeat an earlier one; their ids got a #N suffix",
                 sum(n - 1 for n in collector.copies.values()))
    if not result.conversations:
        what = (f"all {result.skipped} records were malformed (first: {result.errors[0]})" if result.skipped
                else "no records found")
        raise EaglekitError(f"{', '.join(map(str, _as_paths(paths)))}: {what}")
    return result


def read_conversations(paths: str | Path | Sequence[str | Path], skip_errors: bool = False) -> list[Conversation]:
    """The data layer's entry point (docs/CONTRACTS.md): conversations with stable, unique ids.

    `skip_errors=False` stops at the first malformed record (an `EaglekitError` naming file:line and the
    fault); `True` skips and counts them (logged; use `load_conversations` to get the count).
    """
    return load_conversations(paths, skip_errors).conversations
