"""Background shard writer: the target keeps computing while earlier shards go to disk.

The compute side copies each batch's (padding-stripped) hidden states straight into a host shard
buffer (pinned on CUDA, `non_blocking`, so no per-batch sync), at the next free row. A full buffer is
handed to one writer thread with a CUDA event marking the end of its copies; the writer waits on
that event, writes the shard atomically (temp name, fsync, rename), appends its line to the shard
log and returns the buffer. A small ring of buffers bounds host memory; compute waits only when
the disk is slower than the GPU for longer than the ring absorbs.

A writer error (disk full, ...) stops the writer; the next `add_batch`/`close` raises EaglekitError.
Shards already logged stay valid; the failed shard's temp file is removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError
from eaglekit.target.store import StoreLayout, fsync_append, log_name, shard_name, write_safetensors

log = logging.getLogger(__name__)


class _HashingFile:
    """A file wrapper that hashes what is written through it (one pass over the bytes, not two)."""

    def __init__(self, handle: Any):
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)


@dataclass
class _Buffer:
    tensors: dict[str, torch.Tensor]  # name -> (capacity, width) host tensor
    used: int = 0
    ids: list[str] = field(default_factory=list)
    input_ids: list[torch.Tensor] = field(default_factory=list)
    loss_mask: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def clear(self) -> None:
        self.used = 0
        self.ids, self.input_ids, self.loss_mask, self.lengths = [], [], [], []


def write_bytes_atomically(directory: Path, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                           fsync: bool = True) -> tuple[int, str]:
    """Write a shard under a temp name, fsync, rename into place; returns (bytes, sha256). On any error
    the temp file is removed and nothing named `name` is created. Without fsync a process crash is still
    safe (rename is atomic); a power loss may leave a logged shard whose checksum then fails on read."""
    final, tmp = directory / name, directory / f".{name}.tmp"
    try:
        with open(tmp, "wb") as raw:
            hashing = _HashingFile(raw)
            size = write_safetensors(hashing, tensors, metadata)
            raw.flush()
            if fsync:
                os.fsync(raw.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return size, hashing.digest.hexdigest()


class ShardWriter:
    """Accumulate records into bounded shards and write them on a background thread."""

    def __init__(self, directory: str | Path, layout: StoreLayout, capacity_tokens: int, rank: int = 0,
                 start_index: int = 0, num_buffers: int = 2, pin_memory: bool = False, metadata: dict[str, str] | None = None,
                 num_threads: int = 2, fsync: bool = True):
        self.directory, self.layout, self.rank = Path(directory), layout, rank
        self.capacity, self.index, self.fsync = capacity_tokens, start_index, fsync
        self.metadata = metadata or {}
        self.entries: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.wait_seconds = 0.0  # compute time spent waiting for a free buffer (the disk was behind)
        self._free: queue.Queue[_Buffer] = queue.Queue()
        self._full: queue.Queue[tuple[_Buffer, Any, int] | None] = queue.Queue()
        for _ in range(num_buffers):
            tensors = {name: torch.empty(capacity_tokens, width, dtype=dtype, pin_memory=pin_memory)
                       for name, (width, dtype) in layout.widths().items()}
            self._free.put(_Buffer(tensors))
        self._current: _Buffer | None = None
        self._device = torch.device("cpu")
        # several threads: hashing and writing of different shards overlap (both release the GIL)
        self._threads = [threading.Thread(target=self._loop, name=f"eaglekit-shard-writer-r{rank}-{i}", daemon=True)
                         for i in range(max(1, min(num_threads, num_buffers)))]
        for thread in self._threads:
            thread.start()

    # ---- compute side ----
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise EaglekitError(
                f"writing hidden-state shards to {self.directory} failed: {self.error}. Shards written before are intact "
                "and listed in the shard log; no partial shard is kept. Free disk space (or fix the error) and re-run the "
                "same command to resume."
            ) from self.error

    def _acquire(self) -> _Buffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        started = time.perf_counter()
        while True:
            self._raise_if_failed()
            try:
                buffer = self._free.get(timeout=0.5)
                self.wait_seconds += time.perf_counter() - started
                return buffer
            except queue.Empty:
                continue

    def add_batch(self, ids: list[str], input_ids: list[torch.Tensor], loss_mask: list[torch.Tensor],
                  states: dict[str, torch.Tensor]) -> None:
        """Records of one batch: `states[name]` is (N, width) on any device, rows of the records in order
        (N = sum of their lengths); token ids / masks are (T_r,) CPU tensors."""
        self._raise_if_failed()
        rows = sum(len(t) for t in input_ids)
        assert all(s.shape[0] == rows for s in states.values()), "states must hold exactly the records' rows"
        if rows > self.capacity:
            raise EaglekitError(f"a batch of {rows} tokens exceeds the shard buffer ({self.capacity} tokens); raise shard_mb")
        if self._current is not None and self._current.used + rows > self.capacity:
            self._submit()
        if self._current is None:
            self._current = self._acquire()
        buffer = self._current
        self._device = next(iter(states.values())).device
        for name, tensor in states.items():
            buffer.tensors[name][buffer.used:buffer.used + rows].copy_(tensor, non_blocking=True)
        buffer.used += rows
        buffer.ids.extend(ids)
        buffer.input_ids.extend(input_ids)
        buffer.loss_mask.extend(loss_mask)
        buffer.lengths.extend(len(t) for t in input_ids)

    def _submit(self) -> None:
        buffer, self._current = self._current, None
        if buffer is None or buffer.used == 0:
            if buffer is not None:
                self._free.put(buffer)
            return
        event = None
        if self._device.type == "cuda":  # marks the end of this buffer's async copies on the states' stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._full.put((buffer, event, self.index))
        self.index += 1

    def close(self) -> list[dict[str, Any]]:
        """Write the last partial shard, wait for the writer; returns the log entries written this run."""
        if self.error is None:
            self._submit()
        self._stop()
        self._raise_if_failed()
        return self.entries

    def abort(self) -> None:
        """Stop without writing the partial shard (after an error or interrupt)."""
        self._current = None
        self._stop(timeout=60)

    def _stop(self, timeout: float | None = None) -> None:
        for _ in self._threads:
            self._full.put(None)
        for thread in self._threads:
            thread.join(timeout)

    # ---- writer thread ----
    def _loop(self) -> None:
        while (item := self._full.get()) is not None:
            buffer, event, index = item
            if self.error is None:
                try:
                    if event is not None:
                        event.synchronize()
                    self._write(buffer, index)
                except BaseException as error:  # reported to the compute side, which raises EaglekitError
                    self.error = error
            buffer.clear()
            self._free.put(buffer)

    def _write(self, buffer: _Buffer, index: int) -> None:
        n = buffer.used
        offsets = torch.tensor([0] + buffer.lengths, dtype=torch.int64).cumsum(0)
        tensors = {"input_ids": torch.cat(buffer.input_ids).to(torch.int32),
                   "loss_mask": torch.cat(buffer.loss_mask).to(torch.uint8), "offsets": offsets}
        tensors.update({name: t[:n] for name, t in buffer.tensors.items()})
        name = shard_name(self.rank, index)
        size, digest = write_bytes_atomically(self.directory, name, tensors, {"format": "eaglekit", **self.metadata}, self.fsync)
        entry = {"file": name, "rank": self.rank, "index": index, "records": list(buffer.ids), "num_tokens": n,
                 "bytes": size, "sha256": digest}
        fsync_append(self.directory / log_name(self.rank), json.dumps(entry))
        self.entries.append(entry)
        log.debug("wrote %s (%d records, %d tokens, %.1f MB)", name, len(buffer.ids), n, size / 1e6)
