"""Background shard writer: the target keeps computing while earlier shards go to disk.

The compute side copies each batch's (padding-stripped) hidden states straight into a host shard
buffer at the next free row. On CUDA the copies run on a dedicated copy stream (pinned buffers,
`non_blocking`), which first waits for the compute stream to have produced the states, so the
device-to-host copy of one batch overlaps the next forward; `record_stream` keeps the source memory
from being reused until its copy has run. A full buffer is handed to a writer thread with a CUDA event
recorded on the copy stream after its last copy; the writer waits on that event, then hashes and
writes the shard atomically (temp name, fsync, rename), appends its line to the shard log and returns
the buffer. Each thread writes whole shards; several threads write different shards at once (hashing
and file writes release the GIL). The ring of `num_buffers` buffers bounds host memory
(num_buffers x capacity rows); compute waits only when all of them are queued for disk.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_path
from eaglekit.targets.store import StoreLayout, fsync_append, log_name, shard_name, write_safetensors

log = logging.getLogger(__name__)

MAX_AUTO_THREADS = 8  # bounds the auto ring (at most 10 buffers) and leaves cores to the compute thread
_OVERLAP_BYTES = 1 << 20  # blocks at least this large are hashed on a helper thread while being written


def cores_per_process() -> int:
    """CPU cores this process may use, shared among the ranks torchrun starts on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def writer_parallelism(threads: int = 0, buffers: int = 0) -> tuple[int, int]:
    """Resolve (writer threads, host buffers); 0 = auto. Auto threads = half the cores per process,
    2..8; auto buffers = threads + 2 (one being filled by compute, one spare). Threads never exceed
    buffers: a thread without a buffer to write would idle."""
    if threads < 0 or buffers < 0:
        raise EaglekitError(f"writer_threads={threads} and buffers={buffers} must be >= 0 (0 = automatic)")
    threads = threads or min(MAX_AUTO_THREADS, max(2, cores_per_process() // 2))
    buffers = buffers or threads + 2
    return min(threads, buffers), buffers


class _HashingFile:
    """A file wrapper that hashes what is written through it (one pass over the bytes, not two). A large
    block is hashed on the `helper` thread while it is written, so a shard costs about max(hash, write)
    time rather than their sum; blocks are still hashed in order (each hash ends before `write` returns)."""

    def __init__(self, handle: Any, helper: ThreadPoolExecutor):
        self.handle, self.helper, self.digest = handle, helper, hashlib.sha256()

    def write(self, data: Any) -> int:
        if memoryview(data).nbytes < _OVERLAP_BYTES:
            self.digest.update(data)
            return self.handle.write(data)
        hashing = self.helper.submit(self.digest.update, data)
        try:
            return self.handle.write(data)
        finally:  # the bytes are not recycled while being hashed, even after a write error
            hashing.result()


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
    with atomic_path(directory / name) as tmp:
        with ThreadPoolExecutor(1, thread_name_prefix="eaglekit-shard-hash") as helper, open(tmp, "wb") as raw:
            hashing = _HashingFile(raw, helper)
            size = write_safetensors(hashing, tensors, metadata)
            raw.flush()
            if fsync:
                os.fsync(raw.fileno())
    return size, hashing.digest.hexdigest()


class ShardWriter:
    """Accumulate records into bounded shards and write them on background threads.

    `num_threads`/`num_buffers` of 0 are resolved by `writer_parallelism`; the resolved values are
    `self.num_threads`/`self.num_buffers`, and `self.host_bytes` is the ring's host memory."""

    def __init__(self, directory: str | Path, layout: StoreLayout, capacity_tokens: int, rank: int = 0,
                 start_index: int = 0, num_buffers: int = 0, pin_memory: bool = False,
                 metadata: dict[str, str] | None = None,
                 num_threads: int = 0, fsync: bool = True):
        self.directory, self.layout, self.rank = Path(directory), layout, rank
        self.capacity, self.index, self.fsync = capacity_tokens, start_index, fsync
        self.num_threads, self.num_buffers = writer_parallelism(num_threads, num_buffers)
        self.metadata = metadata or {}
        self.entries: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.wait_seconds = 0.0  # compute time spent waiting for a free buffer (the disk was behind)
        self._free: queue.Queue[_Buffer] = queue.Queue()
        self._full: queue.Queue[tuple[_Buffer, Any, int] | None] = queue.Queue()
        self.host_bytes = 0
        for _ in range(self.num_buffers):
            tensors = {name: torch.empty(capacity_tokens, width, dtype=dtype, pin_memory=pin_memory)
                       for name, (width, dtype) in layout.widths().items()}
            self.host_bytes += sum(t.nbytes for t in tensors.values())
            self._free.put(_Buffer(tensors))
        self._current: _Buffer | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # created by the first batch of CUDA states
        self._threads = [threading.Thread(target=self._loop, name=f"eaglekit-shard-writer-r{rank}-{i}", daemon=True)
                         for i in range(self.num_threads)]
        for thread in self._threads:
            thread.start()

    # ---- compute side ----
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise EaglekitError(
                f"writing hidden-state shards to {self.directory} failed: {self.error}. Shards "
                "written before are intact and listed in the shard log; no partial shard is kept. Free disk space (or "
                "fix the error) and re-run the same command to resume."
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
            raise EaglekitError(f"a batch of {rows} tokens exceeds the shard buffer ({self.capacity} "
                                "tokens); raise shard_mb")
        if self._current is not None and self._current.used + rows > self.capacity:
            self._submit()
        if self._current is None:
            self._current = self._acquire()
        buffer = self._current
        self._copy({name: buffer.tensors[name][buffer.used:buffer.used + rows] for name in states}, states)
        buffer.used += rows
        buffer.ids.extend(ids)
        buffer.input_ids.extend(input_ids)
        buffer.loss_mask.extend(loss_mask)
        buffer.lengths.extend(len(t) for t in input_ids)

    def _copy(self, destinations: dict[str, torch.Tensor], states: dict[str, torch.Tensor]) -> None:
        """`destinations[name]` (N, width) host rows <- `states[name]`; from CUDA asynchronously, on the copy stream."""
        device = next(iter(states.values())).device
        if device.type != "cuda":
            for name, tensor in states.items():
                destinations[name].copy_(tensor)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        assert self._copy_stream.device == device, f"states moved from {self._copy_stream.device} to {device}"
        self._copy_stream.wait_stream(torch.cuda.current_stream(device))  # the states are produced
        with torch.cuda.stream(self._copy_stream):
            for name, tensor in states.items():
                destinations[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(self._copy_stream)  # its memory is not reused before this copy has run

    def _submit(self) -> None:
        buffer, self._current = self._current, None
        if buffer is None or buffer.used == 0:
            if buffer is not None:
                self._free.put(buffer)
            return
        event = None
        if self._copy_stream is not None:  # after this buffer's copies (all queued on the copy stream)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._full.put((buffer, event, self.index))
        self.index += 1

    def close(self) -> list[dict[str, Any]]:
        """Write the last partial shard, wait for the writers; returns this run's log entries in shard order."""
        if self.error is None:
            self._submit()
        self._stop()
        self._raise_if_failed()
        return sorted(self.entries, key=lambda entry: entry["index"])  # threads finish shards in any order

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
                    if event is not None:  # never write before the buffer's copies have completed
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
        size, digest = write_bytes_atomically(self.directory, name, tensors, {"format": "eaglekit", **self.metadata},
                                              self.fsync)
        entry = {"file": name, "rank": self.rank, "index": index, "records": list(buffer.ids), "num_tokens": n,
                 "bytes": size, "sha256": digest}
        fsync_append(self.directory / log_name(self.rank), json.dumps(entry))
        self.entries.append(entry)
        log.debug("wrote %s (%d records, %d tokens, %.1f MB)", name, len(buffer.ids), n, size / 1e6)
