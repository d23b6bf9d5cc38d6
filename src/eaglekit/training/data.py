"""Training data for the drafter: records, the train/validation split, length-bucketed batches and the
two feature sources (offline: extract shards; online: the frozen target run in-process).

A batch holds, per sequence (right-padded to the batch's longest, rounded up to a multiple of
`pad_to_multiple` so that compiled kernels see few distinct lengths): token ids x (B, T), the assistant
loss mask (B, T), the target aux states (B, T, 3H) and the soft labels derived from the target's final
hidden state through its lm_head, restricted to the draft vocabulary (see `eaglekit.drafters.eagle3.ttt`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from eaglekit.training.objective import soft_labels_from_hidden
from eaglekit.targets.output_head import LogitTransform, logit_transform
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)
POOL_BATCHES = 32  # global batches per length-sorting pool: sorts lengths locally, keeps the order random


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) bool, False on padding
    aux: torch.Tensor  # (B, T, 3*H_target)
    probs: torch.Tensor  # (B, T, Vd) fp32 soft labels
    in_vocab: torch.Tensor  # (B, T) bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


# --- records ------------------------------------------------------------------------------------
def conversation_records(paths: tuple[str, ...], tokenizer: Any, max_length: int,
                         chat_template: str = "", skip_errors: bool = False) -> list[dict[str, Any]]:
    """Tokenised conversations with at least one assistant token: {"id", "input_ids" (T,), "loss_mask" (T,)}
    (`skip_errors`: malformed records are skipped and counted instead of stopping the read)."""
    from eaglekit.data import read_conversations, tokenize_conversations

    conversations = read_conversations(list(paths), skip_errors=skip_errors)
    tokenized = tokenize_conversations(tokenizer, conversations, max_length, chat_template or None, desc="tokenizing")
    return [{"id": r.id, "input_ids": torch.tensor(r.input_ids, dtype=torch.long),
             "loss_mask": torch.tensor(r.loss_mask, dtype=torch.bool)} for r in tokenized.records]


def shard_tokens(dataset: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, loss_mask) of every record of a `HiddenStateDataset`, read without the hidden states."""
    from safetensors import SafetensorError, safe_open

    out = []
    for entry in dataset.manifest["shards"]:
        path = dataset.directory / entry["file"]
        try:
            with safe_open(str(path), framework="pt") as handle:
                ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
                offsets = handle.get_tensor("offsets").tolist()
        except (SafetensorError, OSError) as error:
            raise EaglekitError(f"shard {path} cannot be read ({error}); delete it and its line in the shard log, then "
                                "re-run extract to rebuild it") from None
        out.extend((ids[a:b].long(), mask[a:b].bool()) for a, b in zip(offsets[:-1], offsets[1:]))
    if len(out) != len(dataset):
        raise EaglekitError(f"{dataset.directory}: shards hold {len(out)} records, the manifest lists "
                            f"{len(dataset)}; re-run extract")
    return out


# --- split and batches --------------------------------------------------------------------------
def split_indices(count: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/validation split of `count` records."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = 0 if val_fraction <= 0 or count < 2 else max(1, round(count * val_fraction))
    return sorted(order[num_val:]), sorted(order[:num_val])


def epoch_batches(indices: list[int], lengths: list[int], batch_size: int, world_size: int, seed: int,
                  epoch: int) -> list[list[int]]:
    """Global batches (batch_size * world_size records each) for one epoch: shuffled, length-bucketed
    within pools of POOL_BATCHES batches, incomplete last batch dropped. Rank r takes `batch[r::world]`."""
    size = batch_size * world_size
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
    batches = []
    for start in range(0, len(order), size * POOL_BATCHES):
        pool = sorted(order[start : start + size * POOL_BATCHES], key=lambda i: -lengths[i])
        batches.extend(pool[i : i + size] for i in range(0, len(pool) - size + 1, size))
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffle]


def mean_mask_counts(tokens: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int], max_length: int,
                     num_steps: int) -> torch.Tensor:
    """(K,) mean number of positions per record in TTT step k's accuracy mask. `ttt.step_masks` keeps a
    record's loss-mask positions from 2 + k on, so step k counts its loss tokens less those among its first
    2 + k (tests/test_draft_ttt.py checks this against step_masks). About 20 s per million records."""
    if not indices:
        return torch.zeros(num_steps)
    masks = [tokens[i][1][:max_length].bool() for i in indices]
    total = sum(int(m.sum()) for m in masks)
    # (N, K+1) ones among the first j+1
    head = pad_stack([m[: num_steps + 1] for m in masks], num_steps + 1, False).long().cumsum(1)
    return (total - head[:, 1:].sum(0)).float() / len(indices)


def padded_length(longest: int, multiple: int) -> int:
    """`longest` rounded up to a multiple of `multiple` (>= 1). Right padding is exact: it is outside the loss
    mask, and causal attention never lets a real position see a later (padded) one."""
    assert multiple >= 1, multiple
    return -(-longest // multiple) * multiple


def pad_stack(tensors: list[torch.Tensor], length: int, fill: float | int | bool = 0) -> torch.Tensor:
    """Right-pad along dim 0 to `length` and stack: list of (T_i, ...) -> (B, length, ...)."""
    out = torch.full((len(tensors), length, *tensors[0].shape[1:]), fill, dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out


# --- feature sources ----------------------------------------------------------------------------
class OfflineSource:
    """Records from extract shards; soft labels = softmax(transform(final @ lm_head.T)) over draft columns."""

    def __init__(self, dataset: Any, tokens: list[tuple[torch.Tensor, torch.Tensor]], lm_head_weight: torch.Tensor,
                 t2d: torch.Tensor, max_length: int, transform: LogitTransform = LogitTransform()):
        self.dataset, self.max_length = dataset, max_length
        self.lm_head_weight, self.t2d, self.transform = lm_head_weight, t2d, transform
        ids = dataset.ids
        self.order = sorted(range(len(ids)), key=lambda i: ids[i])  # records by id, as OnlineSource: same split
        self.tokens = [tokens[i] for i in self.order]
        self.lengths = [min(len(ids), max_length) for ids, _ in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices: list[int], device: torch.device, dtype: torch.dtype, pad_to_multiple: int = 1) -> Batch:
        records = [self.dataset[self.order[i]] for i in indices]
        t = padded_length(max(min(len(r["input_ids"]), self.max_length) for r in records), pad_to_multiple)
        cut = [{k: r[k][: self.max_length] for k in ("input_ids", "loss_mask", "aux", "final")} for r in records]
        aux = pad_stack([r["aux"] for r in cut], t).to(device, dtype)  # (B, T, 3H)
        final = pad_stack([r["final"] for r in cut], t).to(device)  # (B, T, H)
        weight = self.lm_head_weight.to(device)
        probs, in_vocab = soft_labels_from_hidden(final.to(weight.dtype), weight, self.t2d.to(device),
                                                  transform=self.transform)
        return Batch(pad_stack([r["input_ids"] for r in cut], t).to(device),
                     pad_stack([r["loss_mask"] for r in cut], t, False).to(device),
                     aux, probs, in_vocab)


class OnlineSource:
    """Tokenised records; the frozen target computes aux states and soft labels per batch, on device."""

    def __init__(self, records: list[dict[str, Any]], target: Any, capture: Any, t2d: torch.Tensor, max_length: int):
        records = sorted(records, key=lambda r: r["id"])  # by id: the split and batches do not depend on file order
        self.records, self.target, self.capture, self.t2d = records, target, capture, t2d
        self.max_length = max_length
        self.lengths = [min(len(r["input_ids"]), max_length) for r in records]
        self.tokens = [(r["input_ids"], r["loss_mask"]) for r in records]

    def __len__(self) -> int:
        return len(self.records)

    @torch.no_grad()
    def batch(self, indices: list[int], device: torch.device, dtype: torch.dtype, pad_to_multiple: int = 1) -> Batch:
        rows = [self.records[i] for i in indices]
        t = padded_length(max(min(len(r["input_ids"]), self.max_length) for r in rows), pad_to_multiple)
        input_ids = pad_stack([r["input_ids"][: self.max_length] for r in rows], t).to(device)
        loss_mask = pad_stack([r["loss_mask"][: self.max_length] for r in rows], t, False).to(device)
        attention = pad_stack([torch.ones(min(len(r["input_ids"]), self.max_length), dtype=torch.long) for r in rows],
                              t).to(device)
        self.capture.reset()
        try:  # the soft labels come from the captured final state: skip the target's own (B, T, V) logits
            self.target(input_ids=input_ids, attention_mask=attention, use_cache=False, logits_to_keep=1)
        except TypeError:  # a model class without `logits_to_keep`
            self.capture.reset()
            self.target(input_ids=input_ids, attention_mask=attention, use_cache=False)
        # with a device_map the states and the lm_head may sit on other devices than the drafter's
        weight = self.target.get_output_embeddings().weight  # (V, H)
        aux = self.capture.aux().to(device, dtype)  # (B, T, 3H)
        final = self.capture.final().to(weight.device)  # (B, T, H)
        probs, in_vocab = soft_labels_from_hidden(final, weight, self.t2d.to(weight.device),
                                                  transform=logit_transform(self.target.config,
                                                                            self.target.get_output_embeddings().bias))
        return Batch(input_ids, loss_mask, aux, probs.to(device), in_vocab.to(device))
