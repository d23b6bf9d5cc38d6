"""How bench times methods against each other so that a change of the machine's load cannot pass for a speed-up.
Pure functions: the schedule, a method's figures from its timings, and the flags on figures no bench can trust.

- `schedule`: for each repeat and each prompt, every method runs back to back, in an order rotated by one method
  per prompt and per repeat; a load change lands on all methods of a prompt alike, and no method is always the
  first to run on a prompt (the one that follows the previous prompt's last method).
- `figures`: a repeat is one pass over the prompts. tokens/s of a repeat = its tokens over its seconds, summed over
  the prompts; the speed-up of a repeat = the method's tokens/s over the baseline's in the same repeat, over the
  prompts both ran (paired: the two ran prompt by prompt under the same load). Each is reported as the median over
  the repeats with its spread, [min, max] over the repeats.
- `flags`: `speedup_above_tau` (T=0 and a median speed-up above tau: a speculative step costs at least one target
  forward and yields tau tokens on average, so more is noise or a bug, never a speed-up); `spread_wider_than_gap`
  (the repeats' spread of the speed-up, [min, max], reaches the baseline's 1x: on the baseline's side of the median
  the spread is at least the gap between the method and the baseline, so on this machine under its load the
  method cannot be told faster or slower than the baseline).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

SPEEDUP_ABOVE_TAU = "speedup_above_tau"
SPREAD_WIDER_THAN_GAP = "spread_wider_than_gap"
BASELINES = ("plain", "hf")  # the speed-up is over the first of these that was measured


@dataclass(frozen=True)
class Timing:
    """One method on one prompt: new tokens, seconds, and the decoder's `DecodeStats` (None for HF's methods)."""

    tokens: int
    seconds: float
    stats: Any = None


Measured = dict[tuple[str, int, int], Timing]  # (method, repeat, prompt) -> its timing


def schedule(methods: Sequence[str], prompts: int, repeats: int) -> list[tuple[int, int, str]]:
    """(repeat, prompt, method) in the order bench runs them: prompt by prompt, every method back to back, the order
    rotated by one method at each prompt and at each repeat (prompt p of repeat r starts with method (p + r) mod n)."""
    order = []
    for repeat in range(repeats):
        for prompt in range(prompts):
            shift = (prompt + repeat) % len(methods)
            order += [(repeat, prompt, method) for method in (*methods[shift:], *methods[:shift])]
    return order


def by_repeat(measured: Measured, method: str) -> dict[int, dict[int, Timing]]:
    """repeat -> prompt -> timing of `method` (only what was measured: an interrupted bench has fewer)."""
    runs: dict[int, dict[int, Timing]] = {}
    for (name, repeat, prompt), timing in measured.items():
        if name == method:
            runs.setdefault(repeat, {})[prompt] = timing
    return {repeat: dict(sorted(runs[repeat].items())) for repeat in sorted(runs)}


def _rate(timings: list[Timing]) -> float | None:
    seconds = sum(t.seconds for t in timings)
    return sum(t.tokens for t in timings) / seconds if seconds > 0 else None


def spread(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def paired_speedups(measured: Measured, method: str, baseline: str) -> list[float]:
    """Per repeat: `method`'s tokens/s over `baseline`'s, both over the prompts both ran in that repeat."""
    ours, theirs = by_repeat(measured, method), by_repeat(measured, baseline)
    speedups = []
    for repeat, runs in ours.items():
        common = [p for p in runs if p in theirs.get(repeat, {})]
        rate, base = _rate([runs[p] for p in common]), _rate([theirs[repeat][p] for p in common])
        if common and rate and base:
            speedups.append(rate / base)
    return speedups


def figures(measured: Measured, method: str, baseline: str | None) -> dict[str, Any]:
    """A method's timing figures over the repeats: seconds (median of a pass's), tokens/s (median, spread, each
    repeat's), and the paired speed-up over `baseline` (median, spread, each repeat's; None without a baseline)."""
    runs = by_repeat(measured, method)
    rates = [r for r in (_rate(list(prompts.values())) for prompts in runs.values()) if r]
    result: dict[str, Any] = {
        "repeats": len(runs),
        "seconds": statistics.median(sum(t.seconds for t in p.values()) for p in runs.values()) if runs else None,
        "tokens_per_second": statistics.median(rates) if rates else None,
        "tokens_per_second_spread": spread(rates), "repeat_tokens_per_second": rates}
    speedups = paired_speedups(measured, method, baseline) if baseline else []
    result.update(baseline=baseline if speedups else None,
                  speedup=statistics.median(speedups) if speedups else None,
                  speedup_spread=spread(speedups), repeat_speedups=speedups)
    return result


def flags(temperature: float, speedup: float | None, speedup_spread: list[float] | None,
          tau: float | None) -> list[str]:
    """What makes a speed-up untrustworthy (empty: none): above tau at T=0; a spread that reaches the baseline's 1x
    (wider, on the baseline's side of the median, than the gap to it)."""
    found = []
    if speedup is None:
        return found
    if temperature == 0 and tau is not None and speedup > tau:
        found.append(SPEEDUP_ABOVE_TAU)
    if speedup_spread and speedup_spread[0] <= 1 <= speedup_spread[1]:
        found.append(SPREAD_WIDER_THAN_GAP)
    return found


def baseline_of(methods: Sequence[str]) -> str | None:
    """The method every speed-up is measured against: plain decoding, else HF generate (None: neither ran)."""
    return next((name for name in BASELINES if name in methods), None)
