"""Bench figures as the run report and bench.md show them: the table of rows with their speed-ups, what a flag on a
speed-up means, the methods bench left out, the headline's speed-up, and the real vLLM's checks and sweep.

A speed-up bench measured paired with plain decoding (`eaglekit.stages.bench.timing`: interleaved prompt by
prompt, median and spread over the repeats) is taken from its row; an older bench.json's rows, and vLLM's, get
tokens/s over the baseline's. A flagged speed-up (`flags`: above tau at T=0, or a spread that reaches the
baseline's 1x) is shown as not measurable, with its figures, and never as the headline.
"""

from __future__ import annotations

import math
from typing import Any

FLAG_WORDS = {  # what each flag means, in the notes under the table and in the headline
    "speedup_above_tau": "above tau, which no speculative step can beat at T=0 (a load change or a bug)",
    "spread_wider_than_gap": "the repeats' spread reaches 1x: neither faster nor slower than the baseline, measurably",
}
FLAG_SHORT = {"speedup_above_tau": "above tau", "spread_wider_than_gap": "spread reaches 1x"}  # table cells


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def bench_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bench rows with `speedup` over plain decoding (else HF generate) at the same temperature: bench's own paired
    figure when the row has one, else tokens/s over the baseline's (vLLM's rows: over `vllm_plain`)."""
    table = []
    for row in rows:
        if "speedup" in row:  # measured paired with its baseline (None: no baseline ran)
            table.append({**row, "baseline": row.get("baseline") if row["speedup"] else None})
            continue
        names = ("vllm_plain",) if row["method"].startswith("vllm_") else ("plain", "hf")  # an engine against itself
        base = next((r for name in names for r in rows if r["method"] == name
                     and r["temperature"] == row["temperature"]), None)
        speed, base_speed = row.get("tokens_per_second"), base.get("tokens_per_second") if base else None
        table.append({**row, "baseline": base["method"] if base else None,
                      "speedup": speed / base_speed if speed and base_speed else None})
    return table


def _spread(row: dict[str, Any], key: str, spec: str) -> str:
    """' (min-max)' over the repeats, when the row was measured more than once."""
    values = row.get(key)
    return f" ({values[0]:{spec}}-{values[1]:{spec}})" if values and row.get("repeats", 1) > 1 else ""


def speedup_cell(row: dict[str, Any]) -> str:
    """A table row's speed-up: 'n/a', '1.23x vs plain (1.20-1.26)', or its figures marked as not measurable."""
    if not row.get("speedup"):
        return "n/a"
    figure = f"{row['speedup']:.2f}x vs {row['baseline']}"
    if row["method"] == row["baseline"]:
        return figure
    figure += _spread(row, "speedup_spread", ".2f")
    if row.get("flags"):
        return f"not measurable here ({'; '.join(FLAG_SHORT.get(f, f) for f in row['flags'])}): {figure}"
    return figure


def method_name(row: dict[str, Any]) -> str:
    """A row's method as a table shows it: with its confidence cut, if it was measured with one."""
    threshold = row.get("verify_threshold")
    return f"{row['method']} (verify >= {threshold:g})" if threshold else row["method"]


def confidence_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The confidence-cut sweep (bench `verify_thresholds=`): per threshold, the drafts verified per step, the share
    of them accepted, tau and the speed-up; nothing when no row has the figures."""
    swept = [r for r in bench_table(rows) if "verified_per_step" in r]
    if not swept:
        return []
    lines = ["", "Confidence cut (`verify_threshold`: only the drafts whose calibrated survival reaches it are "
                 "verified; the output is the same):", "",
             "| method | T | verify_threshold | drafts verified per step | accepted of verified | tau | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in swept:
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r.get('verify_threshold') or 0:g} | "
                     f"{r['verified_per_step']:.2f} | {fmt(r.get('accepted_of_verified'), '.2f')} | "
                     f"{fmt(r.get('tau'), '.2f')} | {speedup_cell(r)} |")
    return lines


def bench_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Bench rows as a markdown table (speed-up over `bench_table`'s baseline; failed rows name their error)."""
    lines = ["| method | T | tokens/s | ms/token | speed-up | decode-phase tokens/s | tau | acceptance per position |",
             "|---|---|---|---|---|---|---|---|"]
    for r in bench_table(rows):
        if "error" in r:
            lines.append(f"| {method_name(r)} | {r['temperature']:g} | failed: {r['error'][:100]} | | | | | |")
            continue
        rates = " ".join(f"{x:.2f}" for x in r.get("acceptance_per_position", []))
        lines.append(f"| {method_name(r)} | {r['temperature']:g} | {fmt(r.get('tokens_per_second'), '.1f')}"
                     f"{_spread(r, 'tokens_per_second_spread', '.1f')} | "
                     f"{fmt(r.get('ms_per_token'), '.2f')} | {speedup_cell(r)} | "
                     f"{fmt(r.get('decode_tokens_per_second'), '.1f')} | "
                     f"{fmt(r.get('tau'), '.2f') if 'tau' in r else ''} | {rates} |")
    return lines


def bench_notes(rows: list[dict[str, Any]], skipped: list[dict[str, str]]) -> list[str]:
    """Lines under the table: how the figures were measured, what its flags mean, and the methods left out."""
    lines = []
    measured = [r for r in rows if "repeats" in r and "speedup" in r]
    if measured:
        lines.append(f"Methods run back to back on each prompt in a rotating order, {measured[0]['repeats']} passes "
                     "over the prompts: tokens/s and speed-up are medians over the passes, (min-max) their spread; "
                     "each speed-up is paired with its baseline in the same pass.")
    for r in rows:
        if r.get("flags"):
            low, high = r.get("speedup_spread") or (r["speedup"], r["speedup"])
            lines.append(f"**{method_name(r)} at T={r['temperature']:g}: speed-up not measurable on this machine under "
                         f"its load** after {r.get('rounds', 1)} round(s) of measurement: {r['speedup']:.2f}x vs "
                         f"{r['baseline']} ({low:.2f}-{high:.2f})"
                         + (f", tau {r['tau']:.2f}" if "tau" in r else "") + "; "
                         + "; ".join(FLAG_WORDS.get(f, f) for f in r["flags"]) + ".")
    lines += [f"{entry['method']}: skipped, {entry['reason']}." for entry in skipped]
    return [item for line in lines for item in ("", line)]


def bench_headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline's decoding figures: the fastest drafting method at the lowest temperature whose speed-up is not
    flagged (tau and speed-up); with none such, the method of highest tau, `speedup` None, and `not_measurable`
    naming each flagged speed-up with its figures."""
    drafting = [r for r in bench_table(rows) if "tau" in r]
    if not drafting:
        return {}
    coolest = min(r["temperature"] for r in drafting)
    rows = [r for r in drafting if r["temperature"] == coolest]
    trusted = [r for r in rows if not r.get("flags")]
    best = (max(trusted, key=lambda r: r["speedup"] or 0.0) if any(r["speedup"] for r in trusted)
            else max(rows, key=lambda r: r["tau"]))
    result = {"method": best["method"], "temperature": coolest, "tau": best["tau"],
              "speedup": None if best.get("flags") else best["speedup"], "baseline": best["baseline"],
              "speedup_spread": best.get("speedup_spread"), "repeats": best.get("repeats")}
    flagged = [{"method": r["method"], "speedup": r["speedup"], "speedup_spread": r.get("speedup_spread"),
                "tau": r["tau"], "flags": r["flags"], "rounds": r.get("rounds", 1)} for r in rows if r.get("flags")]
    if flagged:
        result["not_measurable"] = flagged
    return result


def speedup_text(numbers: dict[str, Any]) -> str:
    """The headline's speed-up in words: the figure with its spread, or why there is none."""
    if numbers.get("speedup"):
        spread = numbers.get("speedup_spread")
        return (f"{numbers['speedup']:.2f}x vs {numbers['baseline']}"
                + (f" ({spread[0]:.2f}-{spread[1]:.2f} over {numbers['repeats']} repeats)"
                   if spread and (numbers.get("repeats") or 1) > 1 else ""))
    flagged = numbers.get("not_measurable")
    if flagged:
        return "not measurable on this machine under its load (" + "; ".join(
            f"{f['method']} {f['speedup']:.2f}x vs {numbers['baseline']}"
            + (f" ({f['speedup_spread'][0]:.2f}-{f['speedup_spread'][1]:.2f})"
               if f.get("speedup_spread") and f["speedup_spread"][0] != f["speedup_spread"][1] else "")
            + f", tau {f['tau']:.2f}: " + ", ".join(FLAG_WORDS.get(x, x) for x in f["flags"])
            for f in flagged) + ")"
    return "no baseline measured"


VLLM_DRAFTER_ROWS = ("vllm_eagle3", "vllm_dflash")  # bench's vLLM run with the drafter, by the method serving it


def vllm_sweep_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The served-by-vLLM concurrency sweep of bench rows: tokens/s without and with the drafter, speed-up, tau."""
    by_name = {r["method"]: r for r in rows if r.get("engine") == "vllm" and "error" not in r and r["temperature"] == 0}
    plain = by_name.get("vllm_plain")
    eagle = next((by_name[name] for name in VLLM_DRAFTER_ROWS if name in by_name), None)
    if not plain or not eagle or not eagle.get("concurrency"):
        return []
    plain_levels = {level["concurrency"]: level for level in plain.get("concurrency", [])}
    lines = [f"vLLM {eagle.get('engine_version')} served (`vllm serve`, T=0), output tokens/s by requests in flight:",
             "",
             f"| concurrency | requests | vllm_plain tokens/s | {eagle['method']} tokens/s | speed-up | tau (served) |",
             "|---|---|---|---|---|---|"]
    for level in eagle["concurrency"]:
        base = plain_levels.get(level["concurrency"], {})
        speed, base_speed = level.get("tokens_per_second"), base.get("tokens_per_second")
        speedup = f"{speed / base_speed:.2f}x" if speed and base_speed else "n/a"
        lines.append(f"| {level['concurrency']} | {level['requests']} | {fmt(base_speed, '.1f')} | "
                     f"{fmt(speed, '.1f')} | {speedup} | {fmt(level.get('tau'), '.3f')} |")
    return lines


def vllm_lossless_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """One line per vLLM temperature: did the drafter keep vLLM's own output (T=0: the same ids per prompt;
    T > 0: the same distribution of the first speculative step's tokens)?"""
    lines = []
    for row in rows:
        if row.get("method") not in VLLM_DRAFTER_ROWS or "error" in row:
            continue
        check = row.get("distribution")
        if check:
            verdict = "follows" if check["matches_plain"] else "does NOT follow"
            lines.append(f"- T={row['temperature']:g}: vLLM's output with the drafter {verdict} its plain output's "
                         f"distribution (p = {check['p_value']:.2g}, {check['samples'][1]} samples x "
                         f"{check['positions']} positions; a lossless engine passes unless p < {check['alpha']:g})"
                         + ("" if check["matches_plain"] else ": its speculative sampling is not lossless here, "
                            "and its tau is not the acceptance of the target's own samples"))
        elif "outputs_equal_plain" in row:
            lines.append(f"- T={row['temperature']:g}: vLLM's output with the drafter equals its plain greedy output "
                         f"on {row['outputs_equal_plain']:.0%} of the prompts")
    return lines


def vllm_checks_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """What bench.md and the report add after the rows for vLLM: the lossless lines, then the served sweep, each
    behind a blank line (nothing when the bench ran no vLLM)."""
    lines: list[str] = []
    for part in (vllm_lossless_markdown(rows), vllm_sweep_markdown(rows)):
        lines += ["", *part] if part else []
    return lines
