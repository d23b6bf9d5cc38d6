"""DFlash training: blocks at sampled anchor positions, their attention mask and the per-position loss, as pure
tensor functions beside `eaglekit.drafters.eagle3.ttt`.

Alignment (raw tokens x_0..x_{T-1}; target logits L_t at position t predict x_{t+1}; m_t = 1 on assistant tokens).
A block of size S at anchor a is what decoding drafts when x_a is the bonus token:
- queries: ids [x_a, mask, ..., mask] (S tokens) at positions a .. a + S - 1;
- context: the target states of positions 0 .. a - 1 (the context keys/values of every layer); the block's queries
  see those and every query of their own block (non-causal), nothing of other blocks;
- block position j (1 .. S-1) drafts x_{a+j}: its soft label is softmax(L_{a+j-1}[t2d]); it is trained where
  x_{a+j} is an assistant token (m_{a+j}) and argmax L_{a+j-1} is in the draft vocabulary, and counted for accuracy
  where m_{a+j}.
- anchors: positions a with m_{a+1} (the first draft is an assistant token), sampled without replacement, at most
  `num_anchors` per sequence; a sequence with fewer fills the rest with invalid anchors (weight 0).
The loss of block position j is a soft cross-entropy summed over its mask and weighted by decay**(j-1), normalised
as TTT's steps are (`eaglekit.drafters.eagle3.ttt.combine_steps`): the K = S - 1 positions play the part of TTT's K
steps.

`block_forward` runs every block of a batch in one forward (SDPA with a boolean mask, or flex attention);
`naive_block_forward` is the reference: one drafter call per block, exactly as decoding makes it.
"""

from __future__ import annotations

from typing import Any

import torch

from eaglekit.training.objective import TTTResult, combine_steps, soft_cross_entropy_sum


def sample_anchors(
    loss_mask: torch.Tensor,  # (B, T) bool, assistant tokens
    num_anchors: int,
    generator: torch.Generator | None = None,  # a CPU generator (None: torch's global one)
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> anchors (B, N) long, valid (B, N) bool with N = num_anchors; anchors sorted, invalid ones at 0."""
    b, t = loss_mask.shape
    eligible = torch.zeros(b, t, dtype=torch.bool)
    eligible[:, : t - 1] = loss_mask[:, 1:].cpu()  # a with m_{a+1}
    keys = torch.rand(b, t, generator=generator).masked_fill(~eligible, 2.0)  # random order, ineligible last
    chosen = keys.argsort(dim=1)[:, :num_anchors]  # (B, N') N' = min(N, T)
    valid = torch.gather(eligible, 1, chosen)
    anchors = torch.where(valid, chosen, torch.zeros_like(chosen))
    anchors, order = torch.sort(anchors.masked_fill(~valid, t), dim=1)  # valid ones first, ascending
    valid = torch.gather(valid, 1, order)
    anchors = anchors.masked_fill(~valid, 0)
    if anchors.shape[1] < num_anchors:
        pad = num_anchors - anchors.shape[1]
        anchors = torch.cat([anchors, torch.zeros(b, pad, dtype=torch.long)], 1)
        valid = torch.cat([valid, torch.zeros(b, pad, dtype=torch.bool)], 1)
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors (B, N) -> (B, N * S) positions a + j, block by block."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)  # (B, N*S)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """input_ids (B, T), anchors (B, N) -> (B, N * S) block tokens [x_a, mask, ..., mask]."""
    b, n = anchors.shape
    ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return ids.flatten(1)  # (B, N*S)


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors (B, N) -> (B, 1, N*S, T + N*S) bool, True = attend: block n's queries see context keys t < a_n and
    the keys of block n."""
    b, n = anchors.shape
    block_of_query = torch.arange(n * block_size, device=anchors.device) // block_size  # (N*S,)
    query_anchor = anchors[:, block_of_query]  # (B, N*S)
    context = torch.arange(seq_len, device=anchors.device)[None, None, :] < query_anchor[:, :, None]  # (B, NS, T)
    own = block_of_query[:, None] == block_of_query[None, :]  # (N*S, N*S)
    return torch.cat([context, own.expand(b, -1, -1)], dim=2)[:, None]  # (B, 1, N*S, T + N*S)


def block_flex_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> Any:
    """The same mask as `block_attention_mask`, as a flex-attention BlockMask (fully masked tiles skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape

    def mask_mod(batch: Any, head: Any, q: Any, kv: Any) -> Any:
        block = q // block_size
        is_context = kv < seq_len
        return (is_context & (kv < anchors[batch, block])) | (~is_context & ((kv - seq_len) // block_size == block))

    return create_block_mask(mask_mod, b, None, n * block_size, seq_len + n * block_size, device=anchors.device)


def drafted_positions(anchors: torch.Tensor, block_size: int, num_positions: int | None = None) -> torch.Tensor:
    """anchors (B, N) -> (B, N, K) positions a + 1 + k of the tokens drafted position k drafts (K = S - 1 drafting
    block positions here; `num_positions` for a layout that drafts from every slot, DSpark's)."""
    k = block_size - 1 if num_positions is None else num_positions
    return anchors[:, :, None] + 1 + torch.arange(k, device=anchors.device)


def block_masks(
    loss_mask: torch.Tensor,  # (B, T) bool
    in_vocab: torch.Tensor,  # (B, T) bool, argmax L_t in the draft vocabulary
    anchors: torch.Tensor,  # (B, N)
    valid: torch.Tensor,  # (B, N) bool
    block_size: int,
    num_positions: int | None = None,  # K; default block_size - 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (train masks, accuracy masks), each (K, B, N): position k of block n drafts x_{a+1+k}, counted where it is
    an assistant token inside the sequence, trained where argmax L_{a+k} is also in the draft vocabulary."""
    t = loss_mask.shape[1]
    drafted = drafted_positions(anchors, block_size, num_positions)  # (B, N, K)
    at = drafted.clamp(max=t - 1)
    accuracy = valid[:, :, None] & (drafted < t) & torch.gather(loss_mask, 1, at.flatten(1)).view(at.shape)
    train = accuracy & torch.gather(in_vocab, 1, (at - 1).flatten(1)).view(at.shape)
    return train.permute(2, 0, 1), accuracy.permute(2, 0, 1)


def block_labels(probs: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 num_positions: int | None = None) -> torch.Tensor:
    """probs (B, T, Vd) soft labels (softmax of L_t over the draft columns) -> (B, N, K, Vd): position k of block n
    learns softmax(L_{a+k}), the target's distribution of x_{a+1+k}."""
    b, t, vd = probs.shape
    at = (drafted_positions(anchors, block_size, num_positions) - 1).clamp(max=t - 1)  # (B, N, K)
    return torch.gather(probs, 1, at.flatten(1)[:, :, None].expand(-1, -1, vd)).view(*at.shape, vd)


def _position_sums(logits: torch.Tensor, labels: torch.Tensor, train: torch.Tensor) -> tuple[list, list]:
    """logits, labels (B, N, K, Vd), train (K, B, N) -> per position k: soft CE sum, top-1 matches."""
    loss_sums, correct = [], []
    for k in range(labels.shape[2]):
        loss_sums.append(soft_cross_entropy_sum(logits[:, :, k], labels[:, :, k], train[k]))
        with torch.no_grad():
            correct.append(((logits[:, :, k].argmax(-1) == labels[:, :, k].argmax(-1)) & train[k]).sum().float())
    return loss_sums, correct


def block_forward(
    drafter: Any,  # DFlashDrafter
    aux: torch.Tensor,  # (B, T, n_aux * H_target)
    input_ids: torch.Tensor,  # (B, T)
    loss_mask: torch.Tensor,  # (B, T) bool
    probs: torch.Tensor,  # (B, T, Vd)
    in_vocab: torch.Tensor,  # (B, T) bool
    anchors: torch.Tensor,  # (B, N)
    valid: torch.Tensor,  # (B, N) bool
    decay: float,
    attention: str = "sdpa",  # "sdpa" (boolean mask) or "flex" (block mask)
    denominators: torch.Tensor | None = None,  # (K,) loss normalisers; default: local train counts
) -> TTTResult:
    """Every block of the batch in one drafter forward (see the module docstring)."""
    b, t = input_ids.shape
    size = drafter.config.block_size
    context = drafter.context(aux, torch.arange(t, device=aux.device).expand(b, t))
    ids = block_input_ids(input_ids, anchors, size, drafter.config.mask_token_id)  # (B, N*S)
    if attention == "flex":
        mask: Any = block_flex_mask(anchors, t, size)
    else:
        mask = block_attention_mask(anchors, t, size)
    logits = drafter(ids, block_positions(anchors, size), context, mask)  # (B, N*S, Vd)
    logits = logits.view(b, anchors.shape[1], size, -1)[:, :, 1:]  # (B, N, K, Vd) the mask positions
    labels = block_labels(probs, anchors, size)  # (B, N, K, Vd)
    train, accuracy = block_masks(loss_mask, in_vocab, anchors, valid, size)  # (K, B, N) each
    loss_sums, correct = _position_sums(logits, labels, train)
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


def naive_block_forward(
    drafter: Any, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, probs: torch.Tensor,
    in_vocab: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, decay: float,
    denominators: torch.Tensor | None = None,
) -> TTTResult:
    """Reference: one drafter call per valid block, context cut at its anchor, no mask (as decoding drafts)."""
    b, t = input_ids.shape
    size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    k = size - 1
    loss_sums = [torch.zeros((), device=aux.device) for _ in range(k)]
    correct = [torch.zeros((), device=aux.device) for _ in range(k)]
    train = torch.zeros(k, b, anchors.shape[1], dtype=torch.bool, device=aux.device)
    accuracy = torch.zeros_like(train)
    for row in range(b):
        for n, (a, ok) in enumerate(zip(anchors[row].tolist(), valid[row].tolist())):
            if not ok:
                continue
            context = drafter.context(aux[row : row + 1, :a], torch.arange(a, device=aux.device)[None])
            ids = torch.tensor([[int(input_ids[row, a])] + [mask_id] * k], device=aux.device)
            logits = drafter(ids, torch.arange(a, a + size, device=aux.device)[None], context)[0, 1:]  # (K, Vd)
            for j in range(k):
                target = a + 1 + j  # the drafted position
                if target >= t or not loss_mask[row, target]:
                    continue
                accuracy[j, row, n] = True
                if not in_vocab[row, target - 1]:
                    continue
                train[j, row, n] = True
                label = probs[row, target - 1]  # (Vd,)
                loss_sums[j] = loss_sums[j] - (label * torch.log_softmax(logits[j].float(), -1)).sum()
                correct[j] = correct[j] + float(int(logits[j].argmax()) == int(label.argmax()))
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


# --- the training objective -----------------------------------------------------------------
def batch_seed(loss_mask: torch.Tensor, in_vocab: torch.Tensor, seed: int) -> int:
    """A seed from a batch's contents (its loss mask, its in-vocabulary pattern on that mask) and the run's seed: the
    anchors of a batch are a function of the batch, so the loss normalisers and the forward see the same ones,
    validation sees the same ones at every evaluation, and a resumed run draws what the first run drew."""
    bits = torch.cat([loss_mask, in_vocab & loss_mask], dim=1).long()  # (B, 2T) padding reads as False in both
    weights = torch.arange(1, bits.shape[1] + 1, device=bits.device) * 2654435761 % (2**31 - 1)  # (2T,)
    rows = torch.arange(1, bits.shape[0] + 1, device=bits.device)[:, None] * 40503  # (B, 1)
    return (int((bits * ((weights + rows) % (2**31 - 1))).sum()) + seed * 1_000_003) % (2**63 - 1)


class DFlashObjective(torch.nn.Module):
    """The DFlash training objective over a drafter (the contract of `eaglekit.training.objective`), with the
    K = block_size - 1 block positions in place of TTT steps."""

    def __init__(self, drafter: Any, num_anchors: int, decay: float, attention: str, seed: int):
        super().__init__()
        self.drafter, self.num_anchors, self.decay, self.attention, self.seed = (drafter, num_anchors, decay,
                                                                                  attention, seed)

    @property
    def num_positions(self) -> int:
        return self.drafter.config.block_size - 1

    def anchors(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> anchors, valid (B, N) of this batch (`batch_seed`)."""
        generator = torch.Generator().manual_seed(batch_seed(loss_mask, in_vocab, self.seed))
        return sample_anchors(loss_mask, self.num_anchors, generator)

    def masks(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (train, accuracy) masks (K, B, N) of this batch's blocks."""
        anchors, valid = self.anchors(loss_mask, in_vocab)
        return block_masks(loss_mask, in_vocab, anchors, valid, self.drafter.config.block_size)

    def mean_counts(self, tokens: Any, indices: list[int], max_length: int) -> None:
        """None: the blocks are sampled per batch, so each batch's own counts normalise its loss."""
        return None

    def forward(self, aux, input_ids, loss_mask, probs, in_vocab, denominators):  # noqa: ANN001 (see block_forward)
        anchors, valid = self.anchors(loss_mask, in_vocab)
        r = block_forward(self.drafter, aux, input_ids, loss_mask, probs, in_vocab, anchors, valid, self.decay,
                          self.attention, denominators)
        return r.loss, r.loss_sums, r.correct, r.train_counts, r.accuracy_counts
