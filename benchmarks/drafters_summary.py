"""The drafter types side by side from one `run_reference.sh ... drafters` job's results: every decoding row, each
drafter's validation, where a block drafter loses its drafts (block_probe), the 8B-shape step costs, and the goals
(DSpark's tau >= 1.15x DFlash's, the best method >= 2.5x plain, a DSpark step <= 1.15x plain), each with the figures
it is decided on, or missing with the part that did not run.

    python benchmarks/drafters_summary.py --results runs/drafters-results --out benchmarks/results/latest \\
        --command "bash benchmarks/run_reference.sh start drafters" [--step-cost X.json ...] ...

Writes --out/drafters_side_by_side.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eaglekit.manifest import atomic_write_json, atomic_write_text  # noqa: E402
from eaglekit.training.objective import expected_acceptance  # noqa: E402
from reference_summary import conditional, side_by_side  # noqa: E402

GOAL_DSPARK_OVER_DFLASH = 1.15
GOAL_BEST_SPEEDUP = 2.5
GOAL_DSPARK_STEP = 1.15


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def validation(summary: dict[str, Any], results: Path) -> dict[str, Any]:
    """Each variant's validation: from the summary, or from its train manifest (a job cut off before the
    variant's bench and summary)."""
    found = {}
    for kind in ("dspark", "dflash"):
        trained = (summary.get(f"variant_{kind}") or {}).get("trained") or {}
        val, steps = trained.get("val"), trained.get("steps")
        if not val:
            manifest = load(results / f"variant-{kind}" / "train_manifest.json") or {}
            val, steps = manifest.get("val"), manifest.get("steps")
        if val:
            found[kind] = {"accuracy": val["acc_k"], "estimated_tau": expected_acceptance(val["acc_k"]),
                           "steps": steps}
    return found


def goals(methods: list[dict[str, Any]], step_costs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = [r for r in methods if r.get("temperature") == 0.0 and not r.get("verify_threshold")]
    by_drafter = {r["drafter"]: r for r in rows if r["drafter"] in ("dspark", "dflash")}
    found: dict[str, Any] = {}
    if {"dspark", "dflash"} <= set(by_drafter):
        ratio = by_drafter["dspark"]["tau"] / by_drafter["dflash"]["tau"]
        found["dspark_tau>=1.15x_dflash"] = {"dspark_tau": by_drafter["dspark"]["tau"],
                                             "dflash_tau": by_drafter["dflash"]["tau"], "ratio": ratio,
                                             "met": ratio >= GOAL_DSPARK_OVER_DFLASH}
    else:
        found["dspark_tau>=1.15x_dflash"] = {"met": None, "missing": sorted({"dspark", "dflash"} - set(by_drafter))}
    measured = [r for r in rows if r.get("speedup_vs_plain")]
    if measured:
        best = max(measured, key=lambda r: r["speedup_vs_plain"])
        found["best>=2.5x_plain"] = {"drafter": best["drafter"], "method": best["method"],
                                     "speedup": best["speedup_vs_plain"], "tau": best["tau"],
                                     "met": best["speedup_vs_plain"] >= GOAL_BEST_SPEEDUP}
    steps = {name: step for name, step in step_costs.items() if step["kind"] == "dspark"}
    if steps:
        goal: dict[str, Any] = {"ratio_to_plain": {name: step["ratio_to_plain"] for name, step in steps.items()}}
        floors = {name: step["floor_ratio_to_plain"] for name, step in steps.items() if "floor_ratio_to_plain" in step}
        if floors:
            goal["floor_ratio_to_plain"] = floors
        # one DSpark configuration (layers, chain, Markov candidates) with a step this cheap meets it
        met_by = [name for name, step in steps.items() if step["ratio_to_plain"] <= GOAL_DSPARK_STEP]
        goal.update({"met_by": met_by} if met_by else {})
        goal["met"] = bool(met_by)
        found["dspark_step<=1.15x_plain"] = goal
    else:
        found["dspark_step<=1.15x_plain"] = {"met": None, "missing": "no step_cost JSON with a DSpark step"}
    return found


def block_steps(step_costs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The block drafters' 8B-shape steps of step_cost JSON files, each named with its drafter's layers, with the
    card and commit it was measured on."""
    found = {}
    for step_cost in step_costs:
        env = step_cost.get("environment") or {}
        for kind in ("dflash", "dspark"):
            figures = step_cost.get(kind) or {}
            for name, step in (figures.get("steps") or {}).items():
                layers = (figures.get("drafter") or {}).get("layers")
                found[name if layers is None else f"{name}, {layers} layers"] = {
                    "kind": kind, **{k: v for k, v in step.items() if k.endswith("ratio_to_plain")},
                    "gpu": env.get("gpu"), "commit": env.get("commit")}
    return found


def probes(results: Path) -> dict[str, Any]:
    found = {}
    for path in sorted(results.glob("block_probe_*.json")):
        data = load(path)
        for drafter in (data or {}).get("drafters", {}).values():
            found[path.stem.removeprefix("block_probe_")] = drafter
    return found


def fmt(values: list[float | None] | None) -> str:
    return " ".join("-" if v is None else f"{v:.2f}" for v in values or [])


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Drafter types side by side on the reference target ({env.get('gpu', 'CPU')}, commit "
             f"{env.get('commit')})", ""]
    if not result["complete"]:
        lines += [f"Incomplete: {', '.join(result['missing'])} did not run.", ""]
    lines += ["| drafter | method | drafts | T | tokens/s | speed-up | tau | acceptance per position "
              "| given the one before |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["methods"]:
        speedup = f"{r['speedup_vs_plain']:.2f}x" if r.get("speedup_vs_plain") else "-"
        lines.append(f"| {r['drafter']} | {r['method']} | {r['drafts']} | {r['temperature']:g} | "
                     f"{r['tokens_per_second']:.1f} | {speedup} | {r['tau']:.2f} | {fmt(r['acceptance_per_position'])} "
                     f"| {fmt(conditional(r['acceptance_per_position']))} |")
    plain = ', '.join(f'{v:.1f} tok/s at T={t}' for t, v in result['plain'].items()) or "not measured (no speed-ups)"
    lines += ["", f"Plain: {plain}.", "",
              "Validation (the run's held-out split, teacher-forced accuracy per position):", ""]
    for kind, val in result["validation"].items():
        lines.append(f"- {kind}: {fmt(val['accuracy'])}, estimated tau {val['estimated_tau']:.2f} "
                     f"({val['steps']} steps)")
    if result["block_probe"]:
        lines += ["", "Where the drafts are lost (benchmarks/block_probe.py, T=0, the bench's prompts; acceptance of "
                  "each position given the one before):", "",
                  "| drafter | decoded (eager) | decoded (static) | training forward at the decode's blocks | agree | "
                  "training forward at every position | validation (calibration) |", "|---|---|---|---|---|---|---|"]
        for kind, p in result["block_probe"].items():
            decoded = p["decoded"]
            at = p["teacher_forced_at_decode_anchors"]
            lines.append(f"| {kind} | {fmt(decoded['eager']['conditional'])} | "
                         f"{fmt(decoded.get('static', {}).get('conditional'))} | {fmt(at['conditional'])} | "
                         f"{at['agree']:.3f} | {fmt(p['teacher_forced_all_anchors']['conditional'])} | "
                         f"{fmt(p['validation'].get('calibration_conditional'))} |")
    if result["step_cost"]:
        lines += ["", "8B-shaped steps (random weights; the floor: the drafter's weights at the copy bandwidth with the "
                  "rest of the measured step):", ""]
        for name, step in result["step_cost"].items():
            floor = (f", floor {step['floor_ratio_to_plain']:.3f}x" if "floor_ratio_to_plain" in step else "")
            lines.append(f"- {name}: {step['ratio_to_plain']:.3f}x plain{floor} ({step['gpu']}, commit "
                         f"{step['commit']})")
    lines += ["", "Goals (T=0):", ""]
    for name, goal in result["goals"].items():
        state = "missing" if goal["met"] is None else ("met" if goal["met"] else "not met")
        def figure(key: str, value: Any) -> str:
            if isinstance(value, dict):  # figures by step: "ratio_to_plain: dspark7 1.166, ..."
                return f"{key}: " + ", ".join(figure(k, v) for k, v in value.items())
            if isinstance(value, list):  # the steps that meet it
                return f"{key}: " + ", ".join(map(str, value))
            return f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"

        figures = "; ".join(figure(k, v) for k, v in goal.items() if k != "met")
        lines.append(f"- {name}: {state} ({figures})")
    lines += [""] + [paragraph + "\n" for paragraph in result["findings"]]
    lines += ["Commands:", ""] + [f"    {c}" for c in result["commands"]]
    return "\n".join(lines) + "\n"


def build(results: Path, commands: list[str], findings: list[str] = (), step_cost_files: list[Path] = ()) -> dict[str, Any]:
    """`step_cost_files`: the step_cost JSON files to read (default: the job's step_cost_8b.json)."""
    summary = load(results / "summary.json") or {}
    methods = side_by_side(summary) or summary.get("methods") or []  # from the benches, when the summary has them
    step_costs = [load(Path(f)) for f in step_cost_files or [results / "step_cost_8b.json"]]
    step_costs = [c for c in step_costs if c] or ([summary["step_cost_8b"]] if summary.get("step_cost_8b") else [])
    parts = {"bench": summary.get("bench"), "variant_dspark": summary.get("variant_dspark"),
             "variant_dflash": summary.get("variant_dflash"), "step_cost_8b": step_costs}
    variant = summary.get("variant_dspark") or summary.get("variant_dflash") or {}
    plain = {str(r["temperature"]): r["tokens_per_second"] for r in (summary.get("bench") or {}).get("rows", [])
             if r["method"] == "plain"}
    steps = block_steps(step_costs)
    missing = [name for name, part in parts.items() if not part]
    environment = variant.get("environment") or summary.get("environment", {})
    return {"benchmark": "drafters_side_by_side", "environment": environment,
            "complete": not missing, "missing": missing, "plain": plain, "methods": methods,
            "validation": validation(summary, results), "block_acceptance": summary.get("block_acceptance"),
            "calibration": summary.get("calibration"), "block_probe": probes(results), "step_cost": steps,
            "goals": goals(methods, steps), "reference_target": summary.get("reference_target"),
            "commands": commands, "findings": list(findings)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, help="a drafters job's results folder (runs/drafters-results)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--command", action="append", default=[], help="the job's commands, as run (repeatable)")
    parser.add_argument("--finding", action="append", default=[], help="a paragraph on what the figures show")
    parser.add_argument("--step-cost", action="append", default=[], type=Path,
                        help="a step_cost JSON with block drafters' 8B-shape steps (repeatable; default: the "
                             "results' step_cost_8b.json)")
    args = parser.parse_args(argv)
    result = build(Path(args.results), args.command, args.finding, args.step_cost)
    out = Path(args.out)
    atomic_write_json(out / "drafters_side_by_side.json", result)
    atomic_write_text(out / "drafters_side_by_side.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
