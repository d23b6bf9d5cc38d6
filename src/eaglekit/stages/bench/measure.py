"""Timing eaglekit's and HF's methods at one temperature: the runner (one method on one prompt), the warm-up, and the
interleaved rounds of `eaglekit.stages.bench.timing.schedule`, measured again while a figure is flagged.

A round is `repeats` passes over the prompts, every method back to back on each prompt. A round whose rows carry
a flag (`timing.flags`) is measured again from scratch, at most `remeasure` more times; the rows are the last
round's, with the earlier rounds' speed-ups and flags in `earlier_rounds`. A row still flagged keeps its flags:
bench.md and the run report then say its speed-up is not measurable on this machine under its load.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from eaglekit import registry
from eaglekit.config.decode import CHAIN_METHODS
from eaglekit.stages.bench.timing import Measured, Timing, baseline_of, by_repeat, figures, flags, schedule

if TYPE_CHECKING:
    from eaglekit.decode import DecodeStats

log = logging.getLogger(__name__)

DRAFTER_METHODS = registry.method_names()  # need drafter=: every drafter type's methods
CUT = "@"  # a method measured with a confidence cut: "dspark@0.3" (bench's `verify_thresholds`)


def cut_label(method: str, threshold: float) -> str:
    """The name a method measured with `verify_threshold=threshold` runs under (the method itself at 0)."""
    return f"{method}{CUT}{threshold:g}" if threshold > 0 else method


def split_label(label: str) -> tuple[str, float]:
    """(method, verify_threshold) of a name `cut_label` made."""
    method, _, threshold = label.partition(CUT)
    return method, float(threshold or 0.0)


def takes_draft_topk(method: str) -> bool:
    """Whether `method` drafts with a Markov head (the methods bench's `draft_topk` applies to)."""
    return method in registry.method_names() and registry.speculative_method(method).markov


def row_label(row: dict[str, Any]) -> str:
    return cut_label(row["method"], row.get("verify_threshold") or 0.0)
Runner = Callable[[str, list[int], float], tuple[int, float, Any]]  # (method, prompt ids, T) -> tokens, s, stats


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """Runs one method on one prompt -> (new tokens, seconds, the decoder's `DecodeStats` or None for HF)."""

    def __init__(self, config, target, drafter, assistant, tokenizer, eos, backend, device, max_prompt: int):
        self.config, self.target, self.drafter, self.assistant = config, target, drafter, assistant
        self.tokenizer, self.eos, self.device = tokenizer, eos, device
        from eaglekit.decode import Decoder

        longest = max_prompt + config.max_new_tokens + max(config.total_tokens, config.chain_length) + 2
        self.decoder = Decoder(target, drafter, backend, config.compile and device.type == "cuda", max_length=longest)

    def __call__(self, label: str, ids: list[int], temperature: float) -> tuple[int, float, "DecodeStats | None"]:
        import torch

        method, threshold = split_label(label)
        _sync(self.device)
        start = time.perf_counter()
        if method.startswith("hf"):
            kwargs: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": self.config.max_new_tokens,
                                      "eos_token_id": list(self.eos) or None,
                                      "pad_token_id": self.tokenizer.pad_token_id or 0}
            if temperature > 0:
                kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
            if method == "hf_assisted":
                kwargs["assistant_model"] = self.assistant
            if method == "hf_prompt_lookup":
                kwargs["prompt_lookup_num_tokens"] = self.config.prompt_lookup_num_tokens
            prompt = torch.tensor([ids], device=self.device)
            out = self.target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
            _sync(self.device)
            return out.shape[1] - len(ids), time.perf_counter() - start, None
        c = self.config
        result = self.decoder.generate(ids, c.max_new_tokens, method=method, temperature=temperature, depth=c.depth,
                                       tree_top_k=c.tree_top_k, total_tokens=c.total_tokens,
                                       chain_length=c.chain_length, verify_threshold=threshold,
                                       draft_topk=c.draft_topk if takes_draft_topk(method) else 0,
                                       eos_token_ids=self.eos, seed=c.seed)
        _sync(self.device)
        return len(result.tokens), time.perf_counter() - start, result.stats


def method_row(label: str, temperature: float, measured: Measured, baseline: str | None, config) -> dict[str, Any]:
    """bench.json's row of one method (`label`: its name, with a confidence cut `cut_label`'s): the timing figures
    and flags, and (eaglekit's methods) where the time goes and the acceptance, from the first repeat's decoder
    statistics (the same at every repeat at a fixed seed); with a confidence cut, the drafts verified per step."""
    numbers = figures(measured, label, baseline)
    runs = by_repeat(measured, label)
    method, threshold = split_label(label)
    first = list(next(iter(runs.values())).values())
    tokens, seconds, rate = sum(t.tokens for t in first), numbers.pop("seconds"), numbers["tokens_per_second"]
    row: dict[str, Any] = {"method": method, "temperature": temperature, "new_tokens": tokens, "seconds": seconds,
                           **numbers, "ms_per_token": 1000 / rate if rate else None}
    if threshold:
        row["verify_threshold"] = threshold
    stats = [t.stats for t in first if t.stats is not None]
    if not method.startswith("hf"):  # where the time goes: prompts' prefills, and target forwards per new token
        prefill = 0.0
        if stats:  # each prompt's prefill: the median over the repeats
            prompts = next(iter(runs.values()))
            prefill = sum(statistics.median(p[q].stats.prefill_seconds for p in runs.values() if q in p)
                          for q in prompts)
        decode = seconds - prefill
        row.update(prefill_seconds=prefill, target_forwards=sum(s.target_forwards for s in stats),
                   decode_tokens_per_second=tokens / decode if decode > 0 else None)
    if method in DRAFTER_METHODS:
        accepted = [a for s in stats for a in s.accepted]
        row["discarded_steps"] = sum(s.discarded_steps for s in stats)  # fused loop: run past the end, no tokens
        steps = max(len(accepted), 1)
        depth = config.chain_length if method in CHAIN_METHODS else config.depth
        row["tau"] = sum(a + 1 for a in accepted) / steps
        row["acceptance_per_position"] = [sum(a > i for a in accepted) / steps for i in range(depth)]
        if config.verify_thresholds and registry.speculative_method(method).confidence:  # the sweep's figures
            verified = [v for s in stats for v in s.verified] or [depth] * len(accepted)  # no cut: every draft
            row["verified_per_step"] = sum(verified) / max(len(verified), 1)
            row["accepted_of_verified"] = sum(accepted) / sum(verified) if sum(verified) else None
    row["flags"] = [] if label == baseline else flags(temperature, row["speedup"], row["speedup_spread"],
                                                       row.get("tau"))
    return row


def _warm_up(runner: Runner, methods: list[str], temperature: float, prompts: list[list[int]], config,
             failed: dict[str, str]) -> None:
    # eaglekit's own methods warm up on every prompt (a pass takes about a second on a GPU): the first prefill
    # of each prompt length pays one-time costs that must not land on whichever method runs first
    for method in methods:
        for ids in prompts if config.warmup and not method.startswith("hf") else prompts[: config.warmup]:
            if method not in failed:
                _run(runner, method, ids, temperature, failed)


def _run(runner: Runner, method: str, ids: list[int], temperature: float, failed: dict[str, str]) -> Timing | None:
    try:
        return Timing(*runner(method, ids, temperature))
    except Exception as error:  # noqa: BLE001 - one failing method must not lose the others' figures
        log.exception("bench: %s at T=%g failed", method, temperature)
        failed[method] = f"{type(error).__name__}: {error}"
        return None


def _rows(methods: list[str], temperature: float, measured: Measured, failed: dict[str, str], config
          ) -> list[dict[str, Any]]:
    """One row per method in `methods`' order: its figures, or its error; none for a method not measured yet."""
    done = {method for method, _, _ in measured}
    baseline = baseline_of([m for m in methods if m in done and m not in failed])
    rows = []
    for label in methods:
        if label in failed:
            method, threshold = split_label(label)
            rows.append({"method": method, **({"verify_threshold": threshold} if threshold else {}),
                         "temperature": temperature, "error": failed[label]})
        elif label in done:
            rows.append(method_row(label, temperature, measured, baseline, config))
    return rows


def _round(runner: Runner, methods: list[str], temperature: float, prompts: list[list[int]], config,
           failed: dict[str, str], measured: Measured, label: str) -> None:
    from tqdm import tqdm

    order = schedule(methods, len(prompts), config.repeats)
    for repeat, prompt, method in tqdm(order, desc=label, leave=False, disable=None):  # no bar off a terminal
        if method not in failed:
            timing = _run(runner, method, prompts[prompt], temperature, failed)
            if timing is not None:
                measured[(method, repeat, prompt)] = timing


def measure_temperature(runner: Runner, methods: list[str], temperature: float, prompts: list[list[int]], config,
                        save: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """The rows of `methods` at `temperature`, measured in interleaved rounds until none is flagged (at most
    1 + config.remeasure rounds). `save(rows)` gets the rows after each round, and the rows measured so far when
    the bench is interrupted."""
    failed: dict[str, str] = {}
    earlier: dict[str, list[dict[str, Any]]] = {}
    _warm_up(runner, methods, temperature, prompts, config, failed)
    rounds = 1 + config.remeasure
    for index in range(rounds):
        measured: Measured = {}
        label = f"bench T={temperature:g}" + (f" round {index + 1}" if index else "")
        try:
            _round(runner, methods, temperature, prompts, config, failed, measured, label)
        except BaseException:  # Ctrl-C: the rows measured so far, then stop
            save(_with_rounds(_rows(methods, temperature, measured, failed, config), index, earlier))
            raise
        rows = _with_rounds(_rows(methods, temperature, measured, failed, config), index, earlier)
        save(rows)
        flagged = [r for r in rows if r.get("flags")]
        if not flagged:
            return rows
        what = "; ".join(f"{row_label(r)} {r['speedup']:.2f}x ({', '.join(r['flags'])})" for r in flagged)
        if index + 1 < rounds:
            log.warning("bench: T=%g: %s: measuring again (round %d of at most %d)", temperature, what, index + 2,
                        rounds)
        else:
            log.warning("bench: T=%g: %s after %d round(s): not measurable on this machine under its load",
                        temperature, what, rounds)
        for row in rows:
            if "speedup" in row:
                earlier.setdefault(row_label(row), []).append(
                    {key: row[key] for key in ("speedup", "speedup_spread", "tokens_per_second", "flags")})
    return rows


def _with_rounds(rows: list[dict[str, Any]], index: int, earlier: dict[str, list[dict[str, Any]]]
                 ) -> list[dict[str, Any]]:
    for row in rows:
        if "error" not in row:
            row.update(rounds=index + 1, earlier_rounds=earlier.get(row_label(row), []))
    return rows
