"""Drafter types side by side: bench rows of drafters benched on the same prompts in one run, each with its speed-up
over the same plain decoding (`eaglekit run drafter_types=...`'s report, the reference benchmark's summary).

The run's own drafter's rows carry bench's paired speed-up and its flags; a further type's bench ran no plain
decoding, so its speed-up is tokens/s over the first bench's plain (not paired), flagged when above tau at T=0."""

from __future__ import annotations

from typing import Any

from eaglekit.report.bench import method_name


def side_by_side(plain_rows: list[dict[str, Any]], sources: list[tuple[str, dict[str, Any], list[dict[str, Any]]]]
                 ) -> list[dict[str, Any]]:
    """Every drafting row of each source (drafter type, its bench config, its bench rows) with its speed-up over the
    plain row of `plain_rows` at the same temperature: drafters benched on the same prompts in one run."""
    plain = {r["temperature"]: r["tokens_per_second"] for r in plain_rows
             if r.get("method") == "plain" and r.get("tokens_per_second")}
    rows = []
    for drafter, config, source in sources:
        for r in source:
            if r.get("tau") is None or not r.get("tokens_per_second"):
                continue
            drafts = (f"tree {config.get('total_tokens')} tokens, depth {config.get('depth')}" if r["method"] == "tree"
                      else f"{config.get('chain_length')}")
            base = plain.get(r["temperature"])
            paired = r.get("baseline") == "plain" and r.get("speedup")  # measured beside plain in the same bench
            speedup = r["speedup"] if paired else r["tokens_per_second"] / base if base else None
            flags = list(r.get("flags") or []) if paired else (  # another bench's plain: not paired, only checked
                ["speedup_above_tau"] if speedup and r["temperature"] == 0 and speedup > r["tau"] else [])
            rows.append({"drafter": drafter, "method": method_name(r), "drafts": drafts,
                         "temperature": r["temperature"],
                         "tokens_per_second": r["tokens_per_second"], "speedup_vs_plain": speedup, "tau": r["tau"],
                         "acceptance_per_position": r.get("acceptance_per_position") or [], "flags": flags,
                         **({"verify_threshold": r["verify_threshold"]} if r.get("verify_threshold") else {})})
    return rows


def side_by_side_markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| drafter | method | drafts | T | tokens/s | speed-up | tau | acceptance per position |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] else "n/a"
        if r.get("flags"):  # above tau at T=0, or a spread reaching 1x: noise, not a speed-up
            speedup = f"not measurable here ({speedup}: {', '.join(r['flags'])})"
        lines.append(f"| {r['drafter']} | {r['method']} | {r['drafts']} | {r['temperature']:g} | "
                     f"{r['tokens_per_second']:.1f} | {speedup} | {r['tau']:.2f} | "
                     f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_position'])} |")
    return lines
