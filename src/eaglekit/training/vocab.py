"""The draft vocabulary: token counts over loss-masked tokens, top-N selection, the d2t/t2d encoding,
`vocab.safetensors` I/O, and remapping `lm_head` rows when a drafter's vocabulary is rebuilt.

Encoding (as the EAGLE reference and the serving engines read it): the kept target ids `used_ids` are
sorted ascending; `d2t[i] = used_ids[i] - i` is an OFFSET (target id = draft id + d2t[draft id]), int64;
`t2d` is a boolean mask over the target vocabulary, True for kept ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eaglekit.errors import EaglekitError

DEFAULT_SIZE = 32000
VOCAB_FILE = "vocab.safetensors"


@dataclass(frozen=True)
class VocabMapping:
    used_ids: torch.Tensor  # (Vd,) int64 target ids, sorted ascending
    vocab_size: int  # target vocabulary size V
    counts: torch.Tensor | None = None  # (V,) int64 loss-masked token counts, when known

    @property
    def d2t(self) -> torch.Tensor:
        """(Vd,) int64 offsets: target id = draft id + d2t[draft id]."""
        return self.used_ids - torch.arange(self.used_ids.numel())

    @property
    def t2d(self) -> torch.Tensor:
        """(V,) bool, True for target ids in the draft vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.used_ids] = True
        return mask

    def coverage(self, counts: torch.Tensor | None = None) -> float:
        """Share of the counted training tokens whose id the draft vocabulary keeps."""
        counts = self.counts if counts is None else counts
        if counts is None or int(counts.sum()) == 0:
            return float("nan")
        return float(counts[self.used_ids].sum()) / float(counts.sum())


def count_tokens(records: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Records of (input_ids (T,), loss_mask (T,)) -> (V,) int64 counts of the loss-masked ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in records:
        ids = torch.as_tensor(input_ids, dtype=torch.long)[torch.as_tensor(loss_mask, dtype=torch.bool)]
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise EaglekitError(
                f"token id {int(ids.max())} is outside the target vocabulary of {vocab_size}: the data was "
                "tokenized with another tokenizer; re-run regen/extract with this target's tokenizer"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_vocab(counts: torch.Tensor, size: int = DEFAULT_SIZE) -> VocabMapping:
    """Top-`size` ids by count (ties: lower id first), sorted ascending. size >= V keeps every id."""
    vocab_size = counts.numel()
    size = min(size, vocab_size)
    if size <= 0:
        raise EaglekitError(f"draft vocabulary size must be positive, got {size}")
    order = torch.argsort(-counts, stable=True)  # descending count, ascending id among ties
    used_ids = torch.sort(order[:size]).values
    return VocabMapping(used_ids=used_ids, vocab_size=vocab_size, counts=counts)


def mapping_from_drafter(drafter: torch.nn.Module) -> VocabMapping:
    """The mapping stored in a drafter's `d2t` buffer."""
    d2t = drafter.d2t.detach().cpu().long()
    return VocabMapping(used_ids=d2t + torch.arange(d2t.numel()), vocab_size=int(drafter.t2d.numel()))


def save_vocab(path: str | Path, mapping: VocabMapping) -> Path:
    """Write `vocab.safetensors` (d2t int64, t2d bool, counts int64) atomically."""
    from eaglekit.manifest import atomic_path

    path = Path(path)
    tensors = {"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous()}
    if mapping.counts is not None:
        tensors["counts"] = mapping.counts.to(torch.long).contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "eaglekit-vocab", "vocab_size": str(mapping.vocab_size)})
    return path


def load_vocab(path: str | Path) -> VocabMapping:
    """Read `vocab.safetensors` (a file, or a directory holding one) and check d2t and t2d agree."""
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    if not path.is_file():
        raise EaglekitError(f"no draft vocabulary at {path}; run `eaglekit vocab` first or leave vocab= empty")
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise EaglekitError(f"{path} is damaged or not a safetensors file ({error}); re-run `eaglekit vocab`") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise EaglekitError(f"{path} lacks d2t/t2d tensors; it is not a draft vocabulary file")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    used_ids = d2t + torch.arange(d2t.numel())
    if not torch.equal(torch.nonzero(t2d).flatten(), used_ids):
        raise EaglekitError(f"{path}: d2t and t2d disagree; the file is damaged, re-run `eaglekit vocab`")
    return VocabMapping(used_ids=used_ids, vocab_size=t2d.numel(), counts=tensors.get("counts"))


def remap_rows(
    weight: torch.Tensor,  # (Vd_old, H) rows indexed by old draft ids
    old_ids: torch.Tensor,  # (Vd_old,) target ids of the old draft vocabulary
    new_ids: torch.Tensor,  # (Vd_new,) target ids of the new draft vocabulary
    fresh: torch.Tensor,  # (Vd_new, H) initial rows for ids the old vocabulary lacked
) -> tuple[torch.Tensor, int]:
    """New lm_head rows: a kept target id's row moves to its new index; new ids take `fresh` rows.

    Returns (weight (Vd_new, H), number of rows carried over).
    """
    position = torch.full((int(max(old_ids.max(), new_ids.max())) + 1,), -1, dtype=torch.long)
    position[old_ids] = torch.arange(old_ids.numel())
    source = position[new_ids]  # (Vd_new,) old row index or -1
    kept = source >= 0
    out = fresh.clone().to(weight.dtype)
    out[kept] = weight[source[kept]]
    return out, int(kept.sum())


def select_coverage(mapping: VocabMapping, count_tokens_fn: Callable[[], torch.Tensor]) -> float:
    """Share of the counted tokens the mapping covers (its own counts, else `count_tokens_fn()`)."""
    counts = mapping.counts if mapping.counts is not None else count_tokens_fn()
    return mapping.coverage(counts)
