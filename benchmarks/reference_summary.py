"""The reference benchmark's summary (benchmarks/run_all.py --parts summary): the headline figures as markdown and
every drafter type's bench rows side by side with their speed-up over the same run's plain decoding."""

from __future__ import annotations

from eaglekit.report.compare import side_by_side as rows_side_by_side
from eaglekit.report.compare import side_by_side_markdown

VARIANT_KEYS = ("variant", "variant_p-eagle", "variant_dflash")  # run_variant's outputs: eagle3, and by drafter type


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
                     f"({fraction:.1%} of the bound); step / plain: "
                     + ", ".join(f"{name} {step['ratio_to_plain']:.3f}" for name, step in cost["steps"].items()))
        for row in cost.get("projection", []):
            speed.append(f"- projection at the 8B shape, {row['method']} T={row['temperature']:g}: tau {row['tau']:.2f} x "
                         f"plain / step = {row['projected_speedup']:.2f}x (reference target measured {row['reference_measured_speedup']:.2f}x)")
    speed += [variant_line(summary[key]) for key in VARIANT_KEYS if summary.get(key)]
    if speed:
        lines += ["## Speed and peers", "", *speed, ""]
    return "\n".join(lines)


def side_by_side(summary: dict) -> list[dict]:
    """Every speculative row of the run's bench (EAGLE-3) and of the drafter-type variants, with its speed-up over
    the run's own plain decoding at the same temperature (all benched on the same prompts in one run)."""
    bench = (summary.get("bench") or {}).get("rows", [])
    config = (summary.get("bench") or {}).get("config") or {}
    sources = [("eagle3", config, bench)]  # a variant's bench_options: its chain_length, depth and total_tokens
    sources += [(summary[key]["variant"].get("drafter_type", "eagle3 variant"), {**config, **summary[key].get("bench_options", {})},
                 summary[key]["bench"]) for key in VARIANT_KEYS if summary.get(key)]
    return [r for r in rows_side_by_side(bench, sources) if r["speedup_vs_plain"] is not None]


def variant_line(variant: dict) -> str:
    """One markdown line of a `run_variant` result: its options, val accuracy per position beside the baseline's,
    and its bench taus."""
    def accuracy(side: str) -> str:
        return " ".join(f"{a:.3f}" for a in ((variant[side].get("val") or {}).get("acc_k") or [])) or "-"

    return (f"- variant {variant['variant']}: val accuracy per position {accuracy('trained')} (baseline "
            f"{accuracy('baseline')}); "
            + ", ".join(f"{r['method']} T={r['temperature']:g} tau {r['tau']:.2f}" for r in variant["bench"] if r.get("tau")))
