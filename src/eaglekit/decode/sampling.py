"""Sampling helpers: logits -> probabilities (temperature, top-k, top-p) and draws from them.

Pure tensor functions, no model calls. Temperature 0 means greedy everywhere in `eaglekit.decode`.
Draws are inverse-CDF samples on the device: exact, no host synchronisation, and an explicit
`torch.Generator` makes them reproducible.
"""

from __future__ import annotations

import torch


def logits_to_probs(
    logits: torch.Tensor,  # (..., V)
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """(..., V) float32 probabilities after temperature, top-k (0 = off) and nucleus top-p (1 = off).

    temperature 0 returns the one-hot distribution of the argmax (greedy as a distribution).
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


class PreDrawn:
    """Uniforms drawn ahead of a captured graph (which cannot take a generator), handed out in the order the
    code that runs in the graph asks for them: passed where a generator goes, it makes that code draw the
    same numbers as with the generator itself."""

    def __init__(self, values) -> None:
        self.values = list(values)


def rand(shape: tuple[int, ...], generator: torch.Generator | PreDrawn | None, device: torch.device) -> torch.Tensor:
    """torch.rand(shape) from `generator`, or the next pre-drawn uniforms."""
    if isinstance(generator, PreDrawn):
        return generator.values.pop(0)
    return torch.rand(shape, generator=generator, device=device)


def sample(probs: torch.Tensor, generator: torch.Generator | PreDrawn | None = None) -> torch.Tensor:
    """(..., V) probabilities (need not sum to 1) -> (...) long ids, one categorical draw per row.

    Inverse CDF: the first id whose cumulative mass exceeds u * total, u ~ U[0, 1). Zero-mass ids are
    never drawn; one uniform per row instead of one exponential per id (a tree verifies every node's draw)."""
    cdf = probs.float().cumsum(-1)  # (..., V)
    u = rand(tuple(cdf.shape[:-1]) + (1,), generator, cdf.device)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def choose(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(..., V) logits -> (...) ids: argmax at temperature 0, else a draw from `logits_to_probs`."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, temperature, top_k, top_p), generator)


def draft_probs_to_target(
    draft_probs: torch.Tensor,  # (..., Vd) over the draft vocabulary
    draft_to_target_ids: torch.Tensor,  # (Vd,) target id of every draft id
    target_vocab_size: int,
) -> torch.Tensor:
    """Scatter a draft-vocabulary distribution onto the target vocabulary: (..., V), zero elsewhere."""
    shape = draft_probs.shape[:-1] + (target_vocab_size,)
    out = torch.zeros(shape, dtype=draft_probs.dtype, device=draft_probs.device)
    index = draft_to_target_ids.expand(draft_probs.shape)
    return out.scatter(-1, index, draft_probs)
