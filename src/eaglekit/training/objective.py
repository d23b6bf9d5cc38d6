"""What every drafter type's training objective shares: soft labels from the target's logits, the summed soft
cross-entropy, the per-position sums an objective returns and their weighting, and the acceptance estimate.

The objective contract (a module per drafter type: `eaglekit.drafters.eagle3.ttt.TTTModule`, P-EAGLE's, DFlash's):
`num_positions` K (drafted positions per anchor: TTT steps, mask slots, block positions); `masks(loss_mask,
in_vocab)` -> (train, accuracy) masks (K, B, N); `mean_counts(tokens, indices, max_length)` -> (K,) mean positions
per record in each position's mask, or None where positions are sampled (`step_weighting=tokens` needs them);
forward(aux, input_ids, loss_mask, probs, in_vocab, denominators (K,)) -> (loss, loss_sums (K,), correct (K,),
train_counts (K,), accuracy_counts (K,)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_DECAY = 0.8  # the loss weight of position k is decay**k (EAGLE's 0.8)

def step_weights(num_steps: int, decay: float = DEFAULT_DECAY) -> torch.Tensor:
    """(K,) weights decay**k."""
    return torch.tensor([decay**k for k in range(num_steps)], dtype=torch.float32)


def soft_labels(target_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits (B, T, V), t2d (V,) bool -> (probs over draft columns (B, T, Vd) fp32, in_vocab (B, T))."""
    in_vocab = t2d[target_logits.argmax(-1)]  # (B, T)
    probs = torch.softmax(target_logits[..., t2d].float(), dim=-1)  # (B, T, Vd)
    return probs, in_vocab


@torch.no_grad()
def soft_labels_from_hidden(
    final: torch.Tensor,  # (B, T, H) target final-norm output
    lm_head_weight: torch.Tensor,  # (V, H) target lm_head
    t2d: torch.Tensor,  # (V,) bool
    chunk_tokens: int = 4096,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_labels(transform(final @ W.T), t2d)` computed over token chunks, never holding all (B*T, V) logits;
    `transform`: what the target's forward does to its lm_head output (`eaglekit.targets.output_head`)."""
    b, t, h = final.shape
    flat = final.reshape(b * t, h).to(lm_head_weight.dtype)
    probs, in_vocab = [], []
    for start in range(0, b * t, chunk_tokens):
        logits = flat[start : start + chunk_tokens] @ lm_head_weight.T  # (n, V)
        if transform is not None:
            logits = transform(logits)
        p, v = soft_labels(logits[None], t2d)
        probs.append(p[0])
        in_vocab.append(v[0])
    return torch.cat(probs).view(b, t, -1), torch.cat(in_vocab).view(b, t)


def soft_cross_entropy_sum(
    logits: torch.Tensor,  # (B, T, Vd) drafter logits
    probs: torch.Tensor,  # (B, T, Vd) target probabilities
    mask: torch.Tensor,  # (B, T) bool
) -> torch.Tensor:
    """Sum over masked positions of -sum_v p_v log q_v (fp32 scalar)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    per_position = -(probs * log_q).sum(-1)  # (B, T)
    return (per_position * mask).sum()


@dataclass
class TTTResult:
    """Per-step sums; normalise with the counts (after all-reducing them in distributed runs)."""

    loss: torch.Tensor  # scalar: sum_k w_k * loss_sums[k] / denominators[k]
    loss_sums: torch.Tensor  # (K,) summed soft CE of each step over its train mask
    correct: torch.Tensor  # (K,) top-1 matches with the target argmax on the accuracy mask
    train_counts: torch.Tensor  # (K,) positions in each step's train mask
    accuracy_counts: torch.Tensor  # (K,) positions in each step's accuracy mask


def combine_steps(
    loss_sums: list[torch.Tensor], correct: list[torch.Tensor], train: torch.Tensor, accuracy: torch.Tensor,
    decay: float, denominators: torch.Tensor | None,
) -> TTTResult:
    loss_sums_t, correct_t = torch.stack(loss_sums), torch.stack(correct)
    train_counts = train.sum(dim=(1, 2)).float()
    if denominators is None:
        denominators = train_counts.clamp(min=1.0)
    weights = step_weights(len(loss_sums), decay).to(loss_sums_t.device)
    loss = (weights * loss_sums_t / denominators.to(loss_sums_t.device)).sum()
    return TTTResult(loss, loss_sums_t.detach(), correct_t, train_counts, accuracy.sum(dim=(1, 2)).float())


def correct_count(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits, probs (B, T, Vd), mask (B, T) -> () top-1 matches of the drafter with the target on `mask`."""
    return ((logits.argmax(-1) == probs.argmax(-1)) & mask).sum().float()


def expected_acceptance(accuracy: list[float]) -> float:
    """tau estimate = 1 + sum_k prod_{j<=k} acc_j (acc_j: top-1 accuracy of TTT position j)."""
    tau, running = 1.0, 1.0
    for acc in accuracy:
        running *= acc
        tau += running
    return tau
