"""vLLM's hidden-state connector as eaglekit's capture uses it (loaded BY vLLM: imports only vllm, torch, safetensors).

vLLM's `extract_hidden_states` method stores the states of the requested layers in a cache-only KV layer; its
`ExampleHiddenStatesConnector` copies a finished request's rows out of those blocks into one safetensors file
(`{"hidden_states": [T, n_ids, H], "token_ids": [T]}`). This subclass changes two things:

- a request whose `kv_transfer_params` say `{"save": false}` writes nothing and frees its blocks at once (the
  generation half of regenerate-and-capture: its states are read again, from the prefix cache, by the capture
  request that follows it);
- off CUDA the write is synchronous (the stock one needs CUDA streams, events and pinned memory): the rows are
  copied out of the cache, written under a temporary name and renamed into place, so a file that exists is
  complete. On CUDA the stock asynchronous write runs unchanged (the fast path; completion is read from its
  per-file lock).

vLLM imports this module by name (`kv_connector_module_path="vllm_capture_connector"`), with this folder on
PYTHONPATH (`eaglekit.vllm.capture` sets both).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """What `get_finished` polls in place of a CUDA event: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


class EaglekitHiddenStatesConnector(ExampleHiddenStatesConnector):
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if params.get("save", True) is False:
            filename = self._request_filenames.pop(request.request_id, None)
            if filename is not None:  # the lock a writer would have held: no file comes, none is left behind
                with contextlib.suppress(FileNotFoundError):
                    os.remove(filename + ".lock")
            return False, None
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()  # (blocks * block_size,)
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # (T, n_ids, H)
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        temporary = pending.filename + ".tmp"
        save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, temporary)
        os.replace(temporary, pending.filename)
        lock = self._lock_fds.pop(pending.req_id, None)
        if lock is not None:
            os.close(lock)
        self._req_copy_events[pending.req_id] = _Written()  # type: ignore[assignment]
