"""`eaglekit.vllm.distribution`: the per-position two-sample test behind bench's lossless check at T > 0."""

from __future__ import annotations

import pytest
import torch

from eaglekit.vllm.distribution import compare, homogeneity, p_value


def test_p_values_are_chi_square_tail_probabilities():
    assert p_value(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert p_value(51.18, 24) == pytest.approx(0.001, abs=2e-5)  # the threshold test_decode_sampling_stats uses
    assert p_value(0.0, 3) == 1.0 and p_value(12.0, 0) == 1.0


def test_homogeneity_of_a_hand_counted_table():
    first, second = [1] * 30 + [2] * 10, [1] * 10 + [2] * 30  # expected 20 each: 4 x (10^2 / 20) = 20
    statistic, df = homogeneity(first, second)
    assert statistic == pytest.approx(20.0) and df == 1
    rare = [7, 8, 9]  # three tokens seen once each: one shared bin, not three
    assert homogeneity(first + rare, second)[1] == 2


def draws(probs: torch.Tensor, n: int, positions: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, n * positions, replacement=True, generator=g).view(n, positions).tolist()


def test_samples_of_one_distribution_match_and_of_two_do_not():
    p = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), 0)  # its most likely token: 0.29
    same = compare(draws(p, 400, 4, 1), draws(p, 400, 4, 2))
    assert same["matches_plain"] and same["positions"] == 4 and same["samples"] == [400, 400]
    q = p.clone()
    q[p.argmax()] *= 3  # the most likely token 3x as often: a speculative sampler that over-accepts its drafts
    shifted = compare(draws(p, 400, 4, 1), draws(q / q.sum(), 400, 4, 2))
    assert not shifted["matches_plain"] and shifted["p_value"] < 1e-3
    with pytest.raises(ValueError, match="no samples"):
        compare([], [[1]])
