"""Does an engine's speculative decoding sample what its plain decoding samples? A test per output position.

At T > 0 speculative decoding is lossless only if every token it emits has the target's distribution. The
check takes the same prompts sampled many times with and without the drafter, the first `L` tokens of each
(EOS ignored, so every sample has every position), and compares, position by position, the tokens the two
runs put there by Pearson's chi-square test of homogeneity. Samples of different requests are independent
and both runs pool the same prompts the same number of times, so under losslessness the two pooled
distributions at each position are one and the same. Position 0 comes from the prefill alone (a control);
the later ones from the speculative steps. The positions' p-values are combined by Bonferroni (L x the
smallest), and the outputs are taken to match when that is at least `ALPHA`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

ALPHA = 1e-3  # a lossless engine is flagged once in a thousand checks
MIN_BIN = 10  # tokens seen fewer times (both runs together) share one bin


def homogeneity(first: list[int], second: list[int]) -> tuple[float, int]:
    """Pearson's chi-square of a 2 x B table (the two runs' counts of each token, rare tokens binned
    together) -> (statistic, degrees of freedom)."""
    a, b = Counter(first), Counter(second)
    common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= MIN_BIN]
    rows = [[a[t] for t in common], [b[t] for t in common]]
    rest = [len(first) - sum(rows[0]), len(second) - sum(rows[1])]
    if sum(rest):
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    table = torch.tensor(rows, dtype=torch.float64)  # (2, B)
    total = table.sum()
    if table.shape[1] < 2 or not total:
        return 0.0, 0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / total  # (2, B)
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def p_value(statistic: float, df: int) -> float:
    """P(chi-square with `df` degrees of freedom >= statistic); 1 for an empty test."""
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def compare(plain: list[list[int]], speculative: list[list[int]], alpha: float = ALPHA) -> dict[str, Any]:
    """Samples (each a list of the first L token ids) of the same prompts without and with speculation -> the
    per-position p-values, their Bonferroni combination and whether the outputs match (see the module)."""
    positions = min(min(map(len, plain), default=0), min(map(len, speculative), default=0))
    if not positions:
        raise ValueError("no samples to compare: each run needs samples with at least one token")
    per_position = [p_value(*homogeneity([s[j] for s in plain], [s[j] for s in speculative]))
                    for j in range(positions)]
    combined = min(1.0, positions * min(per_position))
    return {"samples": [len(plain), len(speculative)], "positions": positions, "p_value": combined,
            "p_value_per_position": per_position, "alpha": alpha, "matches_plain": combined >= alpha}
