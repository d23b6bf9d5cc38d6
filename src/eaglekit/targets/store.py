"""The hidden-state store written by `extract` and read by training: safetensors shards + manifest.json.

Directory layout:
  shard-r{rank:02d}-{index:05d}.safetensors   records of one rank, whole records only, bounded size
  shards-r{rank:02d}.jsonl                    one line per COMPLETE shard (appended after its atomic rename)
  extract_run.json                            identity of the run (target, tokenizer, layers, dtype): resume guard
  manifest.json                               written last by rank 0: its presence means the store is finished

Tensors of one shard (N = tokens in the shard, R = records, H = target hidden size):
  input_ids (N,) int32 · loss_mask (N,) uint8 · offsets (R+1,) int64 (record r = rows offsets[r]:offsets[r+1])
  aux (N, 3H) · final (N, H) in the storage dtype; with float8_e4m3fn also aux_scale (N, 3) and
  final_scale (N, 1) float32: one scale per token and per layer ("per-row"), value = fp8 * scale.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from eaglekit.errors import EaglekitError
from eaglekit.manifest import file_sha256, read_manifest

log = logging.getLogger(__name__)

STORE_FORMAT = "eaglekit-hidden-states-v1"
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                  "float8_e4m3fn": torch.float8_e4m3fn}
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                       torch.float8_e4m3fn: "F8_E4M3",
                       torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}
RUN_FILE = "extract_run.json"
_OPEN_SHARDS = 16  # shards a reader keeps open at once (shuffled training reads jump between shards)


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:02d}-{index:05d}.safetensors"


def log_name(rank: int) -> str:
    return f"shards-r{rank:02d}.jsonl"


@dataclass(frozen=True)
class StoreLayout:
    """Widths and dtype of the stored tensors; `bytes_per_token` sizes shards and buffers."""

    hidden_size: int
    num_aux: int = 3
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise EaglekitError(f"unknown storage dtype '{self.dtype}'; use one of {', '.join(STORAGE_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    def widths(self) -> dict[str, tuple[int, torch.dtype]]:
        """Per-token tensors: name -> (row width, dtype)."""
        out = {"aux": (self.num_aux * self.hidden_size, self.torch_dtype),
               "final": (self.hidden_size, self.torch_dtype)}
        if self.quantized:
            out.update(aux_scale=(self.num_aux, torch.float32), final_scale=(1, torch.float32))
        return out

    @property
    def bytes_per_token(self) -> int:
        hidden = sum(width * torch.empty(0, dtype=dtype).element_size() for width, dtype in self.widths().values())
        return hidden + 4 + 1  # + input id (int32) + loss mask (uint8)


# ---- float8 storage: pure tensor functions -------------------------------------------------------

def quantize_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, G*H) float -> ((N, G*H) float8_e4m3fn, (N, G) float32 scales); one scale per row and group."""
    n = x.shape[0]
    grouped = x.float().view(n, groups, -1)  # (N, G, H)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (N, G, 1)
    quantized = (grouped / scale).to(torch.float8_e4m3fn).view(n, -1)
    return quantized, scale.view(n, groups)


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_rows`: (N, G*H) fp8 and (N, G) scales -> (N, G*H) `dtype`."""
    n, groups = scale.shape
    return (quantized.float().view(n, groups, -1) * scale.view(n, groups, 1)).view(n, -1).to(dtype)


# ---- shard files ---------------------------------------------------------------------------------

def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def write_safetensors(handle: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write CPU tensors in the safetensors format straight from their memory (no serialised copy).
    Returns the bytes written. Readable by `safetensors.safe_open`."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes it
    handle.write(len(encoded).to_bytes(8, "little"))
    handle.write(encoded)
    for tensor in tensors.values():
        if tensor.numel():
            handle.write(_raw(tensor))
    return 8 + len(encoded) + offset


def read_shard_log(directory: Path, rank: int) -> list[dict[str, Any]]:
    """Complete shards of one rank whose file is present with the logged size (others are not trusted)."""
    path = directory / log_name(rank)
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash: that shard is not trusted
            log.warning("ignoring a torn line in %s", path)
            continue
        file = directory / entry["file"]
        if file.is_file() and file.stat().st_size == entry["bytes"]:
            entries.append(entry)
        else:
            log.warning("shard %s is missing or has the wrong size; it will be extracted again", entry["file"])
    return entries


def shard_ranks(directory: Path) -> list[int]:
    return sorted(int(p.name[len("shards-r"):-len(".jsonl")]) for p in directory.glob("shards-r*.jsonl"))


def merge_shard_logs(directory: str | Path) -> list[dict[str, Any]]:
    """All ranks' complete shards in (rank, index) order; a record id in two shards is an error."""
    directory = Path(directory)
    entries = [entry for rank in shard_ranks(directory) for entry in read_shard_log(directory, rank)]
    entries.sort(key=lambda e: (e["rank"], e["index"]))
    seen: dict[str, str] = {}
    for entry in entries:
        for record_id in entry["records"]:
            if record_id in seen:
                raise EaglekitError(f"record {record_id} is in both {seen[record_id]} and "
                                    f"{entry['file']} in {directory}; re-run extract with --overwrite")
            seen[record_id] = entry["file"]
    return entries


def split_for_rank(items: list[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's share of `items` (interleaved, so length-sorted batches balance across ranks)."""
    assert 0 <= rank < world_size
    return items[rank::world_size]


# ---- reader --------------------------------------------------------------------------------------

class HiddenStateDataset:
    """Records of a finished extract output: `ds[i] -> {"id", "input_ids" (T,), "loss_mask" (T,) bool,
    "aux" (T, 3H), "final" (T, H)}` (float8 stores come back as bfloat16). Shard checksums are checked
    the first time each shard is opened."""

    def __init__(self, directory: str | Path, verify_checksums: bool = True):
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise EaglekitError(f"{self.directory} has no manifest.json: it is not a finished extract output; "
                                f"run (or re-run: it resumes) `eaglekit extract ... output={self.directory}`")
        if manifest.get("format") != STORE_FORMAT:
            raise EaglekitError(f"{self.directory}/manifest.json is format {manifest.get('format')!r}, expected "
                                f"{STORE_FORMAT}; re-extract with this eaglekit version")
        self.manifest = manifest
        self.layout = StoreLayout(manifest["hidden_size"], len(manifest["aux_layer_ids"]), manifest["dtype"])
        self.verify_checksums = verify_checksums
        self._index = [(s, r) for s, shard in enumerate(manifest["shards"]) for r in range(len(shard["records"]))]
        self._open: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()  # LRU of open (memory-mapped) shards
        self._verified: set[int] = set()  # each shard's checksum is checked once per dataset object

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: open handles are not picklable
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    @property
    def ids(self) -> list[str]:
        return [record for shard in self.manifest["shards"] for record in shard["records"]]

    def _shard(self, number: int) -> tuple[Any, list[int]]:
        if number in self._open:
            self._open.move_to_end(number)
        else:
            from safetensors import safe_open

            entry = self.manifest["shards"][number]
            path = self.directory / entry["file"]
            if not path.is_file():
                raise EaglekitError(f"shard {path} is missing; re-run extract into {self.directory} to rebuild it")
            if self.verify_checksums and number not in self._verified and file_sha256(path) != entry["sha256"]:
                raise EaglekitError(f"shard {path} is corrupt (sha256 differs from the manifest); "
                                    f"delete it and its line in {log_name(entry['rank'])}, then re-run "
                                    "extract to rebuild it")
            try:
                handle = safe_open(str(path), framework="pt")
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as error:  # safetensors raises its own error types for unreadable files
                raise EaglekitError(f"shard {path} cannot be read ({error}); re-extract it") from None
            self._verified.add(number)
            self._open[number] = (handle, offsets)
            if len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[number]

    def __getitem__(self, i: int) -> dict[str, Any]:
        number, r = self._index[i]
        handle, offsets = self._shard(number)
        start, end = offsets[r], offsets[r + 1]
        rows = {name: handle.get_slice(name)[start:end] for name in ("input_ids", "loss_mask", "aux", "final")}
        aux, final = rows["aux"], rows["final"]
        if self.layout.quantized:
            aux = dequantize_rows(aux, handle.get_slice("aux_scale")[start:end])
            final = dequantize_rows(final, handle.get_slice("final_scale")[start:end])
        return {"id": self.manifest["shards"][number]["records"][r], "input_ids": rows["input_ids"].long(),
                "loss_mask": rows["loss_mask"].bool(), "aux": aux, "final": final}

    def validate(self, hidden_size: int | None = None, aux_layer_ids: tuple[int, ...] | None = None,
                 tokenizer_hash: str | None = None, target_config_hash: str | None = None,
                 aux_layer_convention: str | None = None) -> None:
        """Raise EaglekitError when the store was made for a different target/drafter than the caller's."""
        m = self.manifest
        convention = m["aux_layer_convention"]
        if aux_layer_ids is not None and aux_layer_convention and aux_layer_convention != convention:
            from eaglekit.targets.capture import from_input_convention, to_input_convention

            aux_layer_ids = from_input_convention(to_input_convention(tuple(aux_layer_ids), aux_layer_convention),
                                                  convention)
        checks = [("hidden_size", hidden_size, m["hidden_size"]),
                  ("aux_layer_ids", list(aux_layer_ids) if aux_layer_ids is not None else None,
                   list(m["aux_layer_ids"])),
                  ("tokenizer_hash", tokenizer_hash, m["tokenizer_hash"]),
                  ("target_config_hash", target_config_hash, m["target_config_hash"])]
        for name, wanted, stored in checks:
            if wanted is not None and wanted != stored:
                raise EaglekitError(
                    f"hidden states in {self.directory} were extracted with {name}={stored} ({convention} ids, target "
                    f"{m['target']}), but this run uses {wanted}; re-run extract for this "
                    "target/drafter into a new out dir"
                )


def fsync_append(path: Path, line: str) -> None:
    """Append one line durably (the shard log: a line means the shard is complete)."""
    with open(path, "a") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())
