"""bench's timing schedule and figures on synthetic timings (no wall clock): methods interleave prompt by prompt in a
rotating order, speed-ups are paired per repeat, and a speed-up no speculative decoder can reach (above tau at T=0)
or one lost in its spread is flagged and measured again instead of being reported."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from eaglekit.config import load_config
from eaglekit.report import bench_markdown, bench_notes, headline_text
from eaglekit.report.bench import bench_headline
from eaglekit.stages import bench
from eaglekit.stages.bench.timing import (SPEEDUP_ABOVE_TAU, SPREAD_WIDER_THAN_GAP, Timing, figures, flags,
                                          paired_speedups, schedule)

TAU = 2.5  # every synthetic chain step accepts 1.5 drafts on average: [1, 2] alternating


def test_schedule_interleaves_methods_prompt_by_prompt_and_rotates_the_order():
    methods = ["plain", "chain", "tree"]
    order = schedule(methods, prompts=4, repeats=3)
    assert len(order) == 3 * 4 * 3
    blocks = [order[i:i + 3] for i in range(0, len(order), 3)]  # each (repeat, prompt): every method back to back
    assert all({m for _, _, m in b} == set(methods) and len({(r, p) for r, p, _ in b}) == 1 for b in blocks)
    assert [(b[0][0], b[0][1]) for b in blocks] == [(r, p) for r in range(3) for p in range(4)]  # pass after pass
    firsts = [b[0][2] for b in blocks]
    assert firsts[:4] == ["plain", "chain", "tree", "plain"]  # one place further at each prompt
    for prompt in range(4):  # over the repeats, each method runs first on each prompt once
        assert sorted(b[0][2] for b in blocks if b[0][1] == prompt) == sorted(methods)
    assert set(Counter(firsts).values()) == {4}  # each method first on 4 of the 12 (repeat, prompt) pairs


def stats(steps: int) -> SimpleNamespace:
    return SimpleNamespace(accepted=[1, 2] * (steps // 2), prefill_seconds=0.01, target_forwards=steps + 1,
                           discarded_steps=0)


def synthetic(seconds: dict[str, list[list[float]]], tokens: int = 10) -> dict:
    """(method, repeat, prompt) -> Timing from seconds[method][repeat][prompt]."""
    return {(m, r, p): Timing(tokens, s) for m, per_repeat in seconds.items() for r, row in enumerate(per_repeat)
            for p, s in enumerate(row)}


def test_speedup_is_paired_per_repeat_median_and_spread():
    # plain slows down 3x in repeat 1 (load) and chain with it: the paired speed-up stays 2x in every repeat
    measured = synthetic({"plain": [[1.0, 1.0], [3.0, 3.0], [1.0, 1.2]], "chain": [[0.5, 0.5], [1.5, 1.5], [0.4, 0.7]]})
    assert paired_speedups(measured, "chain", "plain") == pytest.approx([2.0, 2.0, 2.2 / 1.1])
    numbers = figures(measured, "chain", "plain")
    assert numbers["speedup"] == pytest.approx(2.0) and numbers["speedup_spread"] == pytest.approx([2.0, 2.0])
    assert numbers["repeat_tokens_per_second"] == pytest.approx([20.0, 20 / 3, 20 / 1.1])
    assert numbers["tokens_per_second"] == pytest.approx(20 / 1.1) and numbers["seconds"] == pytest.approx(1.1)
    assert numbers["tokens_per_second_spread"] == pytest.approx([20 / 3, 20.0]) and numbers["repeats"] == 3
    assert figures(measured, "chain", None)["speedup"] is None  # no baseline measured: no speed-up
    # a prompt one method has not run yet (an interrupted pass) is left out of both sides of that repeat's pair
    del measured[("chain", 2, 1)]
    assert paired_speedups(measured, "chain", "plain")[2] == pytest.approx(1.0 / 0.4)


def test_flags_on_synthetic_figures():
    assert flags(0.0, 3.0, [2.9, 3.1], tau=2.5) == [SPEEDUP_ABOVE_TAU]  # impossible at T=0
    assert flags(1.0, 3.0, [2.9, 3.1], tau=2.5) == []  # sampled: tau bounds it only at T=0
    assert flags(0.0, 2.4, [2.3, 2.5], tau=2.5) == []
    assert flags(0.0, 1.1, [0.9, 1.3], tau=2.5) == [SPREAD_WIDER_THAN_GAP]  # 0.2 below the median > gap 0.1 to 1x
    assert flags(0.0, 0.9, [0.7, 1.0], tau=2.5) == [SPREAD_WIDER_THAN_GAP]  # one pass no faster than plain
    assert flags(0.0, 0.7, [0.65, 0.75], tau=2.5) == []  # slower than plain, and measurably so
    assert flags(0.0, 0.82, [0.58, 0.83], tau=2.8) == []  # a wide spread, but every pass slower than plain
    assert flags(0.0, 1.5, [1.05, 2.9], tau=3.0) == []  # every pass faster than plain
    assert flags(0.0, 6.37, [0.9, 6.5], tau=3.22) == [SPEEDUP_ABOVE_TAU, SPREAD_WIDER_THAN_GAP]
    assert flags(0.0, None, None, tau=2.5) == []


class LoadedMachine:
    """A fake runner on a virtual clock: each call costs its method's work times the load at that moment, and the
    load is `factor` until `until` (virtual seconds), 1 after it; `lie(method, call)` may multiply the reported time
    of a method's n-th timed call on top (a timer that lies). plain: 1 s a prompt; chain: 0.5 s for the same tokens
    at tau 2.5, so its true speed-up is 2x."""

    WORK = {"plain": 1.0, "chain": 0.5}

    def __init__(self, factor: float = 1.0, until: float = 0.0, lie=lambda method, call: 1.0):
        self.now, self.factor, self.until, self.lie = 0.0, factor, until, lie
        self.calls: list[str] = []

    def __call__(self, method, ids, temperature):
        seconds = self.WORK[method] * (self.factor if self.now < self.until else 1.0)
        self.now += seconds
        self.calls.append(method)
        seconds *= self.lie(method, self.calls.count(method) - 1)
        return 16, seconds, stats(10) if method == "chain" else SimpleNamespace(
            accepted=[], prefill_seconds=0.01, target_forwards=17, discarded_steps=0)


def config(**options) -> bench.Config:
    overrides = ["prompts=x.jsonl", "target=t", "warmup=0", "chain_length=3"] + [f"{k}={v}" for k, v in options.items()]
    return load_config(bench.Config, overrides=overrides)


def block_speedup(machine: LoadedMachine, prompts: int, repeats: int) -> float:
    """The earlier schedule, each method as one block over all prompts, on the same fake machine."""
    seconds = {m: sum(machine(m, [1], 0.0)[1] for _ in range(prompts * repeats)) for m in ("plain", "chain")}
    return seconds["plain"] / seconds["chain"]


def test_a_load_change_cannot_pass_for_a_speedup():
    prompts, repeats, load = [[1]] * 6, 3, dict(factor=4.0, until=50.0)  # loaded while plain's block would run
    assert block_speedup(LoadedMachine(**load), len(prompts), repeats) > TAU  # what the block schedule reported
    machine = LoadedMachine(**load)
    rows = bench.measure_temperature(machine, ["plain", "chain"], 0.0, prompts, config(repeats=repeats))
    chain = rows[1]
    assert machine.calls[:4] == ["plain", "chain", "chain", "plain"]  # interleaved, rotating
    assert chain["tau"] == pytest.approx(TAU) and chain["speedup"] == pytest.approx(2.0)
    assert chain["flags"] == [] and chain["rounds"] == 1 and chain["earlier_rounds"] == []
    assert rows[0]["speedup"] == 1.0 and rows[0]["flags"] == []  # the baseline against itself


def test_a_speedup_above_tau_is_measured_again():
    # the timer lies in the first round only: plain's calls read 5x slower, so chain reads 10x > tau 2.5
    machine = LoadedMachine(lie=lambda method, call: 5.0 if method == "plain" and call < 6 else 1.0)
    rows = bench.measure_temperature(machine, ["plain", "chain"], 0.0, [[1]] * 3, config(repeats=2, remeasure=2))
    chain = rows[1]
    assert chain["rounds"] == 2 and chain["flags"] == [] and chain["speedup"] == pytest.approx(2.0)
    assert chain["earlier_rounds"][0]["flags"] == [SPEEDUP_ABOVE_TAU]
    assert chain["earlier_rounds"][0]["speedup"] == pytest.approx(10.0)
    assert len(machine.calls) == 2 * (2 * 3 * 2)  # two rounds of 2 passes over 3 prompts, 2 methods


def test_a_speedup_still_above_tau_is_flagged_and_never_the_headline():
    machine = LoadedMachine(lie=lambda method, call: 5.0 if method == "plain" else 1.0)  # lies every round
    saved = []
    rows = bench.measure_temperature(machine, ["plain", "chain"], 0.0, [[1]] * 2, config(repeats=1, remeasure=1),
                                     save=lambda r: saved.append([dict(x) for x in r]))
    chain = rows[1]
    assert chain["rounds"] == 2 and chain["flags"] == [SPEEDUP_ABOVE_TAU] and chain["speedup"] > chain["tau"]
    assert len(machine.calls) == 2 * 2 * 2 and len(saved) == 2  # 1 + remeasure rounds, bench.json after each
    table = "\n".join(bench_markdown(rows) + bench_notes(rows, []))
    chain_line = next(line for line in table.splitlines() if line.startswith("| chain |"))
    assert "| not measurable here (above tau" in chain_line
    assert "**chain at T=0: speed-up not measurable on this machine under its load** after 2 round(s)" in table
    numbers = bench_headline(rows)
    assert numbers["method"] == "chain" and numbers["speedup"] is None and numbers["tau"] == pytest.approx(TAU)
    text = headline_text(numbers)
    assert text.startswith("tau 2.50 (chain, T=0), speed-up not measurable on this machine under its load (chain ")
    assert "10.00x" in text and "above tau" in text
    assert bench.row_summary(chain).endswith("NOT MEASURABLE here: speedup_above_tau")
