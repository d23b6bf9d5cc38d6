"""The reference benchmark's summary (benchmarks/run_all.py --parts summary): the headline figures as markdown,
every drafter type's bench rows side by side with their speed-up over the same run's plain decoding, and DSpark
against DFlash (the same block backbone): acceptance position by position, and DSpark's confidence calibration."""

from __future__ import annotations

from pathlib import Path

from eaglekit.report.compare import side_by_side as rows_side_by_side
from eaglekit.report.compare import side_by_side_markdown
from eaglekit.report.confidence import calibration_markdown

# run_variant's outputs: eagle3, and by drafter type
VARIANT_KEYS = ("variant", "variant_p-eagle", "variant_dflash", "variant_dspark")
# DSpark is DFlash's block backbone plus a Markov head: the pair whose acceptance is compared position by position
BLOCK_PAIR = ("variant_dflash", "variant_dspark")
BLOCK_KINDS = ("dflash", "dspark")  # step_cost.py's block drafters


def summary_markdown(summary: dict, bench_table: str) -> str:
    """The headline figures of `summarise` as markdown (what is missing is left out, not invented)."""
    env = summary["environment"]
    lines = [f"# Reference benchmark: commit {env.get('commit')}, {env.get('gpu') or env.get('device') or 'no GPU'}, "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}", ""]
    target = summary.get("reference_target")
    if target:
        lines += [f"Reference target: {target.get('parameters', 0) / 1e6:.1f}M parameters, {target.get('train_seconds')} s of "
                  f"training, held-out loss {target.get('heldout_loss')} nats (uniform {target.get('baseline_uniform')}), "
                  f"greedy repetition rate {target.get('repetition_rate')}.", ""]
    steps = (summary.get("run") or {}).get("steps") or []
    if steps:
        lines += ["| stage | seconds | peak GPU GB |", "|---|---|---|"]
        lines += [f"| {s['stage']} | {s['seconds']} | {'-' if s.get('peak_gpu_gb') is None else s['peak_gpu_gb']} |" for s in steps] + [""]
    if bench_table:
        lines += ["## Bench", "", bench_table.strip(), ""]
    if summary.get("methods"):
        lines += ["## Drafter types side by side (same prompts, same run; speed-up over this run's plain at the same T)", "",
                  *side_by_side_markdown(summary["methods"]), ""]
    lines += block_markdown(summary)
    speed = []
    for name in ("decode_speed_reference", "decode_speed_8b"):
        d = summary.get(name)
        if d:
            speed.append(f"- {name}: plain {d['eaglekit_plain_tokens_per_s']:.1f} tok/s ({d['fraction_of_bound']:.1%} of the bound), "
                         f"plain step {d['plain_step_ms']:.2f} ms, speculative steps {d['speculative_step_ms_random_drafter']} ms")
    for method, row in ((summary.get("step_profile") or {}).get("methods") or {}).items():
        speed.append(f"- step_profile {method}: {row['step_ms']:.2f} ms per step (tau {row['tau']:.2f}), "
                     f"{row['kernels_per_step']:.0f} kernels and {row['gpu_ms_per_step']:.2f} ms of GPU time per step uncaptured")
    for row in (summary.get("train_speed") or {}).get("results", []):
        if "tokens_per_s" in row:  # MFU and peak memory are GPU figures: a CPU run has neither
            mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
            peak = f", peak {row['peak_memory_gb']} GB" if row.get("peak_memory_gb") is not None else ""
            speed.append(f"- train_speed {row['kind']}/{row['mode']}/{row['attention']}: {row['tokens_per_s']:,.0f} tok/s"
                         f"{mfu}{peak}")
    regen = summary.get("regen_speed")
    if regen:
        speed.append(f"- regen_speed: regen {regen['regen_tokens_per_second']} vs generate {regen['plain_generate_tokens_per_second']} tok/s")
    for name, d in (summary.get("extract_speed") or {}).items():
        for row in (d or {}).get("results", []):
            speed.append(f"- extract_speed {name} {row['storage_dtype']}: {row['ratio']:.1%} of the bare forward "
                         f"({row['ratio_before_final_flush']:.1%} before the final flush)")
    peer = summary.get("peer_speculators")
    if peer:
        def taus(side: dict) -> str:
            val = side.get("val") or {}
            bench = " ".join(f"{r['method']} {r['tau']:.2f}" for r in (side.get("bench") or {}).get("rows", []) if "tau" in r)
            tau = f"{val['tau']:.2f}" if isinstance(val.get("tau"), float) else "-"
            return f"val tau {tau}, bench tau {bench or '-'}"
        speed.append(f"- peer (speculators, {peer.get('status')}): eaglekit {taus(peer.get('eaglekit') or {})}; "
                     f"peer {taus(peer.get('peer') or {})}")
    cost = summary.get("step_cost_8b")
    if cost:
        fraction = cost["plain_fraction_of_bound"]["fused_projections"]
        speed.append(f"- step_cost ({cost['weights']}): plain {cost['plain_tokens_per_s']['fused_projections']:.1f} tok/s "
                     f"({fraction:.1%} of the bound)" + ("; step / plain: " if cost["steps"] else "")
                     + ", ".join(f"{name} {step['ratio_to_plain']:.3f}" for name, step in cost["steps"].items()))
        for kind in (k for k in BLOCK_KINDS if cost.get(k)):
            if "error" in cost[kind]:
                speed.append(f"- step_cost {kind}: FAILED ({cost[kind]['error']})")
                continue
            drafter, goal = cost[kind]["drafter"], f"{kind}_step<=1.15x_plain"
            heads = f", Markov head rank {drafter['markov_rank']}" if "markov_rank" in drafter else ""
            met = (cost.get("goals") or {}).get(goal)
            speed.append(f"- step_cost {kind} (draft_layers {drafter['layers']}{heads}): step / plain "
                         + ", ".join(f"{name} {step['ratio_to_plain']:.3f}"
                                     for name, step in cost[kind]["steps"].items())
                         + ("" if met is None else f" ({goal}: {'met' if met else 'not met'})"))
        for row in cost.get("projection", []):
            measured = row.get("reference_measured_speedup")
            cut = f", verify_threshold {row['verify_threshold']:g}" if row.get("verify_threshold") else ""
            speed.append(f"- projection at the 8B shape, {row['method']} ({row['shape']}{cut}) "
                         f"T={row['temperature']:g}: tau {row['tau']:.2f} x plain / step = "
                         f"{row['projected_speedup']:.2f}x (reference target measured "
                         + ("-" if measured is None else f"{measured:.2f}x") + ")")
    speed += [variant_line(summary[key]) for key in VARIANT_KEYS if summary.get(key)]
    if speed:
        lines += ["## Speed and peers", "", *speed, ""]
    return "\n".join(lines)


def side_by_side(summary: dict) -> list[dict]:
    """Every speculative row of the run's bench (EAGLE-3) and of the drafter-type variants, with its speed-up over
    the run's own plain decoding at the same temperature (all benched on the same prompts in one run; None while
    the run's bench has not run)."""
    bench = (summary.get("bench") or {}).get("rows", [])
    config = (summary.get("bench") or {}).get("config") or {}
    sources = [("eagle3", config, bench)]  # a variant's bench_options: its chain_length, depth and total_tokens
    sources += [(summary[key]["variant"].get("drafter_type", "eagle3 variant"), {**config, **summary[key].get("bench_options", {})},
                 summary[key]["bench"]) for key in VARIANT_KEYS if summary.get(key)]
    return rows_side_by_side(bench, sources)


def calibrations(summary: dict) -> dict[str, dict]:
    """Variant key -> the confidence calibration its drafter's training recorded (`after_training`: per block
    position, ECE and AUC raw and calibrated), for each variant whose drafter has a calibrated confidence head."""
    return {key: summary[key]["after_training"] for key in VARIANT_KEYS
            if ((summary.get(key) or {}).get("after_training") or {}).get("calibrated")}


def conditional(acceptance: list[float]) -> list[float | None]:
    """Bench's acceptance per position (the fraction of steps whose drafts are accepted up to position k) -> the
    fraction of steps accepting position k among those that accepted k - 1: how well a drafter's drafts hold deeper
    in the block, whatever its first drafts did (None where no step got that far)."""
    before, found = 1.0, []
    for a in acceptance:
        found.append(a / before if before > 0 else None)
        before = a
    return found


def block_acceptance(summary: dict) -> list[dict]:
    """Per temperature, the DFlash and DSpark variants' whole-chain rows (no confidence cut) on the same prompts:
    tau, tokens/s, acceptance per position and its conditional form, and DSpark's acceptance minus DFlash's at each
    position both draft (what DSpark's Markov head is for: drafts that hold deeper in the block)."""
    found: dict[float, dict[str, dict]] = {}
    for key in BLOCK_PAIR:
        variant = summary.get(key) or {}
        for r in variant.get("bench") or []:
            acceptance = r.get("acceptance_per_position")
            if acceptance and not r.get("verify_threshold"):
                found.setdefault(r["temperature"], {})[variant["variant"].get("drafter_type", key)] = {
                    "method": r["method"], "drafts": len(acceptance), "tau": r.get("tau"),
                    "tokens_per_second": r.get("tokens_per_second"), "acceptance_per_position": acceptance,
                    "conditional_acceptance": conditional(acceptance)}
    comparison = []
    for temperature in sorted(found):
        drafters = found[temperature]
        entry: dict = {"temperature": temperature, "drafters": drafters}
        if len(drafters) == 2:
            (first, a), (second, b) = drafters.items()  # DFlash, then DSpark (BLOCK_PAIR's order)
            entry["difference"] = {"of": f"{second} - {first}", "per_position": [
                y - x for x, y in zip(a["acceptance_per_position"], b["acceptance_per_position"])]}
        comparison.append(entry)
    return comparison


def _numbers(values: list[float | None]) -> str:
    return " ".join("-" if v is None else f"{v:.2f}" for v in values)


def block_markdown(summary: dict) -> list[str]:
    """The DSpark-against-DFlash section: acceptance per position, the confidence calibration, the confidence cut's
    rows (nothing when neither variant ran)."""
    comparison = summary.get("block_acceptance") or block_acceptance(summary)
    found = summary.get("calibration") or calibrations(summary)
    cuts = [(summary[key]["variant"].get("drafter_type", key), r) for key in VARIANT_KEYS if summary.get(key)
            for r in summary[key]["bench"] if r.get("verify_threshold") is not None and r.get("tau")]
    if not (comparison or found or cuts):
        return []
    lines = ["## DSpark against DFlash (the same block backbone, the same prompts)", ""]
    if comparison:
        lines += ["Acceptance per position: the fraction of steps whose drafts are accepted up to that position "
                  "(bench's); given the one before: among the steps that accepted the position before. DSpark's Markov "
                  "head corrects each draft by the one before it, so its acceptance should hold deeper in the block "
                  "than DFlash's.", "",
                  "| drafter | method | T | drafts | tau | tokens/s | acceptance per position | given the one before |",
                  "|---|---|---|---|---|---|---|---|"]
    for entry in comparison:
        for name, d in entry["drafters"].items():
            speed = "-" if d["tokens_per_second"] is None else f"{d['tokens_per_second']:.1f}"
            tau = "-" if d["tau"] is None else f"{d['tau']:.2f}"
            lines.append(f"| {name} | {d['method']} | {entry['temperature']:g} | {d['drafts']} | {tau} | {speed} | "
                         f"{_numbers(d['acceptance_per_position'])} | {_numbers(d['conditional_acceptance'])} |")
    lines.append("")
    for entry in (e for e in comparison if "difference" in e):
        lines.append(f"- T={entry['temperature']:g}, {entry['difference']['of']} per position: "
                     + " ".join(f"{v:+.2f}" for v in entry["difference"]["per_position"]))
    if cuts:
        lines += ["", "Confidence cut (`verify_threshold`: only the drafts whose calibrated survival reaches it are "
                  "verified):", "",
                  "| drafter | method | T | verify_threshold | tau | drafts verified per step | tokens/s |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in cuts:
            verified = r.get("verified_per_step")
            lines.append(f"| {name} | {r['method']} | {r['temperature']:g} | {r['verify_threshold']:g} | "
                         f"{r['tau']:.2f} | {'-' if verified is None else f'{verified:.2f}'} | "
                         f"{r.get('tokens_per_second') or 0:.1f} |")
    for key, after in found.items():
        folder = Path((summary[key].get("trained") or {}).get("drafter") or key)
        lines += ["", *calibration_markdown(f"{folder.parent.name}/{folder.name}", after)]
    return [*lines, ""]


def variant_line(variant: dict) -> str:
    """One markdown line of a `run_variant` result: its options, val accuracy per position beside the baseline's,
    and its bench taus."""
    def accuracy(side: str) -> str:
        return " ".join(f"{a:.3f}" for a in ((variant[side].get("val") or {}).get("acc_k") or [])) or "-"

    return (f"- variant {variant['variant']}: val accuracy per position {accuracy('trained')} (baseline "
            f"{accuracy('baseline')}); "
            + ", ".join(f"{r['method']} T={r['temperature']:g} tau {r['tau']:.2f}" for r in variant["bench"] if r.get("tau")))
