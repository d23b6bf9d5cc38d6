"""DSpark training: DFlash's blocks at sampled anchors (`eaglekit.drafters.dflash.train`), the Markov-corrected logits
teacher-forced, and DeepSpec's loss, as pure tensor functions.

Alignment (raw tokens x_0..x_{T-1}; target logits L_t at position t predict x_{t+1}; m_t = 1 on assistant tokens).
The block at anchor a is DFlash's ([x_a, mask, ...] at positions a .., context the states of positions < a). Drafted
position k (0 .. K-1; K = block_size with `sample_from_anchor`, else block_size - 1) reads block slot k + first_slot
and drafts x_{a+1+k}:
- its previous token (the Markov head's input) is x_{a+k}, the ground truth (teacher forcing);
- its soft label is p_k = softmax(L_{a+k}[t2d]), its data token x_{a+1+k};
- it is counted where x_{a+1+k} is an assistant token inside the sequence and every position before it in the block
  is counted too (a contiguous prefix, as DeepSpec's eval mask), and trained where also argmax L_{a+k} is in the draft
  vocabulary.
Loss of position k, summed over its mask (DeepSpec `deepspec/modeling/dspark/loss.py`):
    ce * CE(q_k, x_{a+1+k})  +  l1 * ||q_k - p_k||_1  +  confidence * BCE(c_k, clamp(1 - ||q_k - p_k||_1 / 2))
with q_k the drafter's Markov-corrected distribution, c_k its raw confidence logit (the target detached), CE only where
x_{a+1+k} is in the draft vocabulary; position k weighted decay**k (DeepSpec: exp(-k/4), decay 0.78) and normalised
as every objective's positions are (`eaglekit.training.objective.combine_steps`).

`dspark_block_forward` runs every block of a batch in one backbone forward; `naive_dspark_forward` is the reference:
one drafter call per block, the Markov head stepped position by position, the loss written out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from eaglekit.drafters.dflash.train import (
    batch_seed,
    block_attention_mask,
    block_flex_mask,
    block_input_ids,
    block_labels,
    block_masks,
    block_positions,
    drafted_positions,
    sample_anchors,
)
from eaglekit.training.objective import TTTResult, combine_steps


@dataclass(frozen=True)
class LossWeights:
    """DeepSpec's mix: 0.1 cross-entropy on the data token, 0.9 L1 to the target's distribution, 1.0 confidence BCE."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0


def prefix_masks(loss_mask: torch.Tensor, in_vocab: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (train, accuracy) masks (K, B, N): DFlash's per-position masks (`block_masks`), the accuracy mask cut to
    the contiguous prefix of each block (a position after an uncounted one is not counted)."""
    train, accuracy = block_masks(loss_mask, in_vocab, anchors, valid, block_size, num_positions)
    accuracy = accuracy.long().cumprod(0).bool()
    return train & accuracy, accuracy


def block_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, num_positions: int,
                 shift: int) -> torch.Tensor:
    """input_ids (B, T) -> (B, N, K) x_{a+shift+k} (shift 0: the previous tokens, 1: the drafted ones; positions
    past the sequence read its last token, and are masked)."""
    t = input_ids.shape[1]
    at = (drafted_positions(anchors, block_size, num_positions) - 1 + shift).clamp(max=t - 1)  # (B, N, K)
    return torch.gather(input_ids, 1, at.flatten(1)).view(at.shape)


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """t2d (V,) bool -> (V,) the draft id of each kept target id (the others: -1)."""
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, torch.full_like(t2d, -1, dtype=torch.long))


def position_losses(
    logits: torch.Tensor,  # (B, N, K, Vd) Markov-corrected draft logits
    confidence: torch.Tensor | None,  # (B, N, K) raw confidence logits, or None without the head
    labels: torch.Tensor,  # (B, N, K, Vd) the target's distribution p_k over the draft vocabulary
    data_ids: torch.Tensor,  # (B, N, K) draft ids of the data tokens (-1: outside the draft vocabulary)
    train: torch.Tensor,  # (K, B, N) bool
    weights: LossWeights,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """-> per position k: the summed loss over its train mask, the top-1 matches with the target's argmax."""
    log_q = torch.log_softmax(logits.float(), -1)  # (B, N, K, Vd)
    l1 = (log_q.exp() - labels.float()).abs().sum(-1)  # (B, N, K)
    ce = -log_q.gather(-1, data_ids.clamp(min=0)[..., None])[..., 0] * (data_ids >= 0)  # (B, N, K)
    per_position = weights.ce * ce + weights.l1 * l1
    if confidence is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        per_position = per_position + weights.confidence * F.binary_cross_entropy_with_logits(
            confidence.float(), accept, reduction="none")
    loss_sums, correct = [], []
    for k in range(logits.shape[2]):
        mask = train[k]  # (B, N)
        loss_sums.append((per_position[:, :, k] * mask).sum())
        with torch.no_grad():
            correct.append(((logits[:, :, k].argmax(-1) == labels[:, :, k].argmax(-1)) & mask).sum().float())
    return loss_sums, correct


@dataclass
class BlockOutputs:
    """What the drafter gives every drafted position of a batch's blocks, with the labels and masks of the loss."""

    logits: torch.Tensor  # (B, N, K, Vd) Markov-corrected draft logits
    confidence: torch.Tensor | None  # (B, N, K) raw confidence logits
    labels: torch.Tensor  # (B, N, K, Vd) the target's distribution p_k
    data_ids: torch.Tensor  # (B, N, K) draft ids of the data tokens (-1: outside the draft vocabulary)
    train: torch.Tensor  # (K, B, N) bool
    accuracy: torch.Tensor  # (K, B, N) bool, contiguous prefixes


def block_outputs(
    drafter: Any,  # DSparkDrafter
    aux: torch.Tensor,  # (B, T, n_aux * H_target)
    input_ids: torch.Tensor,  # (B, T)
    loss_mask: torch.Tensor,  # (B, T) bool
    probs: torch.Tensor,  # (B, T, Vd)
    in_vocab: torch.Tensor,  # (B, T) bool
    anchors: torch.Tensor,  # (B, N)
    valid: torch.Tensor,  # (B, N) bool
    attention: str = "sdpa",  # "sdpa" (boolean mask) or "flex" (block mask)
) -> BlockOutputs:
    """Every block of the batch in one backbone forward, then the heads teacher-forced (module docstring)."""
    config = drafter.config
    b, t = input_ids.shape
    size, first, k = config.block_size, config.first_slot, config.max_drafts
    context = drafter.context(aux, torch.arange(t, device=aux.device).expand(b, t))
    ids = block_input_ids(input_ids, anchors, size, config.mask_token_id)  # (B, N*S)
    mask = block_flex_mask(anchors, t, size) if attention == "flex" else block_attention_mask(anchors, t, size)
    hidden = drafter.hidden_states(ids, block_positions(anchors, size), context, mask)  # (B, N*S, H)
    hidden = hidden.view(b, anchors.shape[1], size, -1)[:, :, first:]  # (B, N, K, H) the drafting slots
    logits, e = drafter.markov_logits(hidden, block_tokens(input_ids, anchors, size, k, 0))  # (B, N, K, Vd)
    train, accuracy = prefix_masks(loss_mask, in_vocab, anchors, valid, size, k)  # (K, B, N) each
    return BlockOutputs(logits, drafter.confidence_logits(hidden, e), block_labels(probs, anchors, size, k),
                        target_to_draft(drafter.t2d)[block_tokens(input_ids, anchors, size, k, 1)], train, accuracy)


def dspark_block_forward(
    drafter: Any,  # DSparkDrafter
    aux: torch.Tensor,  # (B, T, n_aux * H_target)
    input_ids: torch.Tensor,  # (B, T)
    loss_mask: torch.Tensor,  # (B, T) bool
    probs: torch.Tensor,  # (B, T, Vd)
    in_vocab: torch.Tensor,  # (B, T) bool
    anchors: torch.Tensor,  # (B, N)
    valid: torch.Tensor,  # (B, N) bool
    decay: float,
    weights: LossWeights = LossWeights(),
    attention: str = "sdpa",  # "sdpa" (boolean mask) or "flex" (block mask)
    denominators: torch.Tensor | None = None,  # (K,) loss normalisers; default: local train counts
) -> TTTResult:
    """Every block of the batch in one backbone forward, DeepSpec's loss per drafted position (module docstring)."""
    out = block_outputs(drafter, aux, input_ids, loss_mask, probs, in_vocab, anchors, valid, attention)
    loss_sums, correct = position_losses(out.logits, out.confidence, out.labels, out.data_ids, out.train, weights)
    return combine_steps(loss_sums, correct, out.train, out.accuracy, decay, denominators)


def naive_dspark_forward(
    drafter: Any, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, probs: torch.Tensor,
    in_vocab: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, decay: float,
    weights: LossWeights = LossWeights(), denominators: torch.Tensor | None = None,
) -> TTTResult:
    """Reference: one drafter call per valid block, context cut at its anchor, no mask; the Markov head stepped
    position by position (its state carried by hand); masks, labels and the loss indexed by hand."""
    config = drafter.config
    b, t = input_ids.shape
    size, first, k = config.block_size, config.first_slot, config.max_drafts
    to_draft = target_to_draft(drafter.t2d)
    loss_sums = [torch.zeros((), device=aux.device) for _ in range(k)]
    correct = [torch.zeros((), device=aux.device) for _ in range(k)]
    train = torch.zeros(k, b, anchors.shape[1], dtype=torch.bool, device=aux.device)
    accuracy = torch.zeros_like(train)
    for row in range(b):
        for n, (a, ok) in enumerate(zip(anchors[row].tolist(), valid[row].tolist())):
            if not ok:
                continue
            context = drafter.context(aux[row : row + 1, :a], torch.arange(a, device=aux.device)[None])
            ids = torch.tensor([[int(input_ids[row, a])] + [config.mask_token_id] * (size - 1)], device=aux.device)
            hidden = drafter.hidden_states(ids, torch.arange(a, a + size, device=aux.device)[None], context)[0]
            state, counted = None, True
            for j in range(k):
                target = a + 1 + j  # the drafted position
                prev = input_ids[row, min(a + j, t - 1)]
                logits, e, state = drafter.position_logits(hidden[first + j], prev, state)
                counted = counted and target < t and bool(loss_mask[row, target])
                if not counted:
                    break
                accuracy[j, row, n] = True
                if not in_vocab[row, target - 1]:
                    continue
                train[j, row, n] = True
                label = probs[row, target - 1].float()  # (Vd,)
                log_q = torch.log_softmax(logits.float(), -1)
                l1 = (log_q.exp() - label).abs().sum()
                data = int(to_draft[input_ids[row, target]])
                loss = weights.l1 * l1 + (weights.ce * -log_q[data] if data >= 0 else 0.0)
                confidence = drafter.confidence_logits(hidden[first + j], e)
                if confidence is not None:
                    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
                    loss = loss + weights.confidence * F.binary_cross_entropy_with_logits(confidence, accept)
                loss_sums[j] = loss_sums[j] + loss
                correct[j] = correct[j] + float(int(logits.argmax()) == int(label.argmax()))
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


class DSparkObjective(torch.nn.Module):
    """DSpark's training objective over a drafter (the contract of `eaglekit.training.objective`): its K drafted
    positions per block play the part of TTT's steps; anchors drawn as DFlash's are."""

    def __init__(self, drafter: Any, num_anchors: int, decay: float, attention: str, seed: int,
                 weights: LossWeights = LossWeights()):
        super().__init__()
        self.drafter, self.num_anchors, self.decay, self.attention, self.seed = (drafter, num_anchors, decay,
                                                                                  attention, seed)
        self.weights = weights

    @property
    def num_positions(self) -> int:
        return self.drafter.config.max_drafts

    def anchors(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> anchors, valid (B, N) of this batch (`dflash.train.batch_seed`: the same at every call)."""
        generator = torch.Generator().manual_seed(batch_seed(loss_mask, in_vocab, self.seed))
        return sample_anchors(loss_mask, self.num_anchors, generator)

    def masks(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (train, accuracy) masks (K, B, N) of this batch's blocks."""
        anchors, valid = self.anchors(loss_mask, in_vocab)
        return prefix_masks(loss_mask, in_vocab, anchors, valid, self.drafter.config.block_size, self.num_positions)

    def mean_counts(self, tokens: Any, indices: list[int], max_length: int) -> None:
        """None: the blocks are sampled per batch, so each batch's own counts normalise its loss."""
        return None

    def forward(self, aux, input_ids, loss_mask, probs, in_vocab, denominators):  # noqa: ANN001 (see the module)
        anchors, valid = self.anchors(loss_mask, in_vocab)
        r = dspark_block_forward(self.drafter, aux, input_ids, loss_mask, probs, in_vocab, anchors, valid, self.decay,
                                 self.weights, self.attention, denominators)
        return r.loss, r.loss_sums, r.correct, r.train_counts, r.accuracy_counts
