"""The run report: `DIR/report.md` and PNG plots, read from the outputs the stages left in a run folder.

Sections: data (records, tokens, loss-masked share, draft-vocabulary coverage), training (loss and
accuracy per TTT position from `train/metrics.jsonl`), decoding (tau, acceptance per position and
speed-up against plain decoding from `bench/bench.json`), export (paths and the vLLM / SGLang launch
commands for this drafter) and the doctor's verdicts. A stage that was not run, or not finished, gets a
line saying so; nothing is estimated in its place.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglekit.manifest import atomic_write_text, read_manifest
from eaglekit.report.bench import (VLLM_DRAFTER_ROWS, bench_headline, bench_markdown, bench_notes, bench_table,
                                   confidence_markdown, speedup_text, vllm_checks_markdown, vllm_lossless_markdown,
                                   vllm_sweep_markdown)
from eaglekit.report.bench import fmt as _fmt
from eaglekit.report.plots import plot_acceptance, plot_training
from eaglekit.report import confidence

log = logging.getLogger(__name__)

__all__ = ["ACCEPTANCE_PLOT", "TRAINING_PLOT", "VLLM_DRAFTER_ROWS", "Report", "bench_markdown", "bench_notes",
           "bench_table", "collect", "headline", "headline_text", "launch_commands", "plot_acceptance", "plot_training",
           "read_metrics", "vllm_checks_markdown", "vllm_lossless_markdown", "vllm_sweep_markdown", "write_report"]
TRAINING_PLOT, ACCEPTANCE_PLOT = "report-training.png", "report-acceptance.png"


@dataclass
class Report:
    path: Path
    headline: dict[str, Any] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)


# ---- reading the run folder -----------------------------------------------------------------------

def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; left out of the report", path)
        return None


def read_metrics(path: Path) -> dict[str, list[dict[str, Any]]]:
    """train's metrics.jsonl -> {"train": [...], "val": [...]} by step; a resumed run's repeats keep the last line."""
    by_step: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interruption
        if isinstance(entry, dict) and entry.get("split") in ("train", "val") and "step" in entry:
            by_step[(entry["split"], int(entry["step"]))] = entry
    return {split: [by_step[k] for k in sorted(k for k in by_step if k[0] == split)] for split in ("train", "val")}


def _extract_loss_tokens(directory: Path, manifest: dict[str, Any]) -> int | None:
    """Loss-masked tokens in the extract store (its small loss_mask tensors only)."""
    try:
        from safetensors import safe_open

        total = 0
        for shard in manifest.get("shards", []):
            with safe_open(str(directory / shard["file"]), framework="pt") as handle:
                total += int(handle.get_tensor("loss_mask").sum())
        return total
    except (OSError, KeyError, RuntimeError, ValueError) as error:
        log.warning("could not count loss-masked tokens in %s: %s", directory, error)
        return None


def _online_data_stats(out: Path, train: dict[str, Any]) -> dict[str, Any] | None:
    """Online training stores no tokens: tokenise its data as train did (cached, keyed by the train step's key)."""
    from eaglekit.errors import EaglekitError
    from eaglekit.manifest import atomic_write_json

    cache, key = out / "report-data.json", (_json(out / "train" / ".run-done") or {}).get("key")
    cached = _json(cache)
    if cached and key and cached.get("key") == key:
        return cached
    config = train.get("config") or {}
    try:
        from eaglekit.training.data import conversation_records
        from eaglekit.targets.loading import load_tokenizer

        tokenizer = load_tokenizer(config["target"], trust_remote_code=bool(config.get("trust_remote_code")))
        records = conversation_records(tuple(config["data"]), tokenizer, int(config["max_length"]),
                                       config.get("chat_template") or "", bool(config.get("skip_errors")))
    except (EaglekitError, OSError, KeyError, ValueError) as error:
        log.warning("could not count the online training data's tokens: %s", error)
        return None
    stats = {"key": key, "num_records": len(records), "num_tokens": sum(len(r["input_ids"]) for r in records),
             "loss_tokens": sum(int(r["loss_mask"].sum()) for r in records)}
    atomic_write_json(cache, stats)
    return stats


def collect(out: str | Path) -> dict[str, Any]:
    """Everything the report shows, from the files in the run folder (None where a stage left nothing)."""
    out = Path(out)
    info: dict[str, Any] = {"out": out, "run": _json(out / "run.json") or {}}
    info["regen"] = _json(out / "regen" / "stats.json") if read_manifest(out / "regen") else None
    extract = read_manifest(out / "extract")
    if extract:
        extract = {**extract, "loss_tokens": _extract_loss_tokens(out / "extract", extract)}
    info["extract"] = extract
    info["vocab"] = read_manifest(out / "vocab")
    info["train"] = read_manifest(out / "train")
    if not extract and info["train"] and info["train"].get("mode") == "online":
        info["extract"] = _online_data_stats(out, info["train"])
    info["metrics"] = read_metrics(out / "train" / "metrics.jsonl")
    info["calibration"] = confidence.calibrations(out)
    info["bench"] = _json(out / "bench" / "bench.json") if read_manifest(out / "bench") else None
    order = (info["run"].get("config") or {}).get("export_formats") or []
    folders = sorted((d for d in (out / "export").glob("*") if d.is_dir() and not d.name.endswith(".old")),
                     key=lambda d: (order.index(d.name) if d.name in order else len(order), d.name))
    info["exports"] = {d.name: read_manifest(d) for d in folders if read_manifest(d)}
    engines = (info["run"].get("config") or {}).get("doctor_engines") or []
    checked = sorted((d for d in (out / "doctor").glob("*") if (d / "doctor.json").is_file()
                      and not d.name.endswith(".old")),
                     key=lambda d: (engines.index(d.name) if d.name in engines else len(engines), d.name))
    info["doctor"] = {d.name: _json(d / "doctor.json") for d in checked}
    kinds = (info["run"].get("config") or {}).get("drafter_types") or []  # bench-<type>/: further drafter types
    others = {k: _json(out / f"bench-{k}" / "bench.json") for k in kinds[1:] if read_manifest(out / f"bench-{k}")}
    info["drafter_types"] = [(kinds[0], info["bench"]), *others.items()] if kinds and info["bench"] else []
    return info


# ---- numbers ------------------------------------------------------------------------------------

def headline(info: dict[str, Any]) -> dict[str, Any]:
    """tau and speed-up of the fastest EAGLE-3 method at the lowest temperature measured (never a flagged speed-up:
    `eaglekit.report.bench.bench_headline`), and the val accuracy."""
    result: dict[str, Any] = bench_headline((info.get("bench") or {}).get("rows", []))
    val = ((info.get("train") or {}).get("val") or {})
    if val.get("acc_k"):
        result.update(val_accuracy=val["acc_k"][0], val_accuracy_per_position=val["acc_k"], val_tau=val.get("tau"))
    return result


def headline_text(numbers: dict[str, Any]) -> str:
    parts = []
    if "tau" in numbers:
        parts.append(f"tau {numbers['tau']:.2f} ({numbers['method']}, "
                     f"T={numbers['temperature']:g}), speed-up {speedup_text(numbers)}")
    if "val_accuracy" in numbers:
        parts.append(f"val accuracy (first draft position) {numbers['val_accuracy']:.3f}")
    return "; ".join(parts) if parts else "no headline numbers (bench and train were not run)"


# ---- sections -----------------------------------------------------------------------------------

def _section_steps(info: dict[str, Any]) -> list[str]:
    steps = info["run"].get("steps") or []
    config = info["run"].get("config") or {}
    lines = ["# eaglekit run report", "", f"Target: `{config.get('target', '?')}`; data: "
             + ", ".join(f"`{d}`" for d in config.get("data", [])) + f"; training: {config.get('training', '?')}.", ""]
    if steps:
        lines += ["| stage | this run | seconds (when it ran) | peak GPU GB | folder |", "|---|---|---|---|---|"]
        lines += [f"| {s['stage']} | {s['status']} | {s['seconds']:.1f} | {_gb(s.get('peak_gpu_gb'))} | "
                  f"`{s['directory']}` |"
                  for s in steps]
    return lines


def _section_data(info: dict[str, Any]) -> list[str]:
    lines = ["", "## Data", ""]
    regen, extract, vocab = info["regen"], info["extract"], info["vocab"]
    if regen:
        lines.append(f"- regen: {regen['finished']} of {regen['records']} records answered by the target "
                     f"({regen['completion_tokens']} new tokens in {regen['answers']} answers, generated in "
                     f"{regen['seconds']:.1f} s)")
    if extract:
        tokens, loss_tokens = extract.get("num_tokens"), extract.get("loss_tokens")
        share = f"{loss_tokens / tokens:.1%}" if loss_tokens is not None and tokens else "n/a"
        stats = extract.get("stats") or {}
        lines.append(f"- records: {extract.get('num_records')}; tokens: {tokens}; loss-masked (assistant) tokens: "
                     f"{_fmt(loss_tokens, 'd')} ({share}); truncated records: {stats.get('truncated', 'n/a')}"
                     + (" (counted from the online training data)" if "key" in extract else ""))
        if "key" not in extract:
            backend = f"vLLM {stats.get('vllm', '')}".strip() if extract.get("backend") == "vllm" else "Hugging Face"
            parallel = stats.get("tensor_parallel_size", 1)
            lines.append(f"- hidden states captured by {backend}: {_fmt(stats.get('tokens_per_second'), '.1f')} "
                         "tokens/s" + (f" over tensor parallel {parallel}" if parallel > 1 else ""))
    if vocab:
        lines.append(f"- draft vocabulary: {vocab['draft_vocab_size']} of {vocab['vocab_size']} ids "
                     f"({vocab.get('mapping')}); coverage {vocab['coverage']:.2%} of "
                     f"{vocab['tokens_counted']} loss-masked tokens ({vocab.get('distinct_tokens')} distinct ids seen)")
    if len(lines) == 3:
        lines.append("Not run (regen, extract and vocab left out or not finished).")
    elif not extract:
        lines.append("- total tokens and loss-masked share: not measured (no extract store and no "
                     "finished online training)")
    return lines


def _passes(train: dict[str, Any]) -> str:
    """How far training went over its data, as the training log says it: passes (4.3), and the epoch the last step
    was in (epoch 5 of the log's `step 60/60 (epoch 5, 4.3 passes)`)."""
    passes = train.get("passes")
    if passes is None:  # a manifest written before passes were recorded: epochs finished
        return f"{train.get('epochs')} epoch(s) finished"
    return f"{passes:.1f} passes over the training records (the last step in epoch {max(1, math.ceil(passes))})"


def _section_training(info: dict[str, Any], plotted: bool) -> list[str]:
    lines = ["", "## Training", ""]
    train = info["train"]
    if not train:
        return lines + ["Not run or not finished (no train/manifest.json)."]
    val = train.get("val") or {}
    lines.append(f"{train.get('mode', '?')} training, {train.get('steps')} optimizer steps: {_passes(train)}, "
                 f"{train.get('train_records')} training / {train.get('val_records')} validation records; drafter: "
                 f"`{info['out'] / 'train'}`.")
    if plotted:
        lines += ["", f"![training curves]({TRAINING_PLOT})"]
    if val.get("acc_k"):
        lines += ["", f"Validation at step {val.get('step')}: loss {val['loss']:.4f}, estimated tau "
                      f"{_fmt(val.get('tau'), '.2f')}.", "",
                  "| TTT position | " + " | ".join(str(k + 1) for k in range(len(val["acc_k"]))) + " |",
                  "|---|" + "---|" * len(val["acc_k"]),
                  "| accuracy | " + " | ".join(f"{a:.3f}" for a in val["acc_k"]) + " |"]
        if val.get("loss_k"):
            lines.append("| loss | " + " | ".join(f"{v:.3f}" for v in val["loss_k"]) + " |")
        from eaglekit.report.notes import loss_note

        note = loss_note(val, float((train.get("config") or {}).get("step_decay", 0.8)))
        lines += ["", note] if note else []
    else:
        lines.append("No validation split (val_fraction=0 or too few records).")
    return lines


def _section_decoding(info: dict[str, Any], plotted: bool) -> list[str]:
    lines = ["", "## Decoding", ""]
    bench = info["bench"]
    if not bench:
        return lines + ["Not run or not finished (no bench/bench.json)."]
    config = bench.get("config") or {}
    lines.append(f"{bench.get('num_prompts')} prompts from `{config.get('prompts')}`, "
                 f"{config.get('max_new_tokens')} new tokens each, {config.get('repeats')} passes (medians over them), "
                 f"backend {bench.get('backend')}, device {config.get('device')}.")
    lines += ["", *bench_markdown(bench.get("rows", [])), *confidence_markdown(bench.get("rows", [])),
              *bench_notes(bench.get("rows", []), bench.get("skipped", []))]
    if plotted:
        lines += ["", f"![acceptance per position]({ACCEPTANCE_PLOT})"]
    if len(info["drafter_types"]) > 1:
        from eaglekit.report.compare import side_by_side, side_by_side_markdown

        sources = [(kind, result.get("config") or {}, [r for r in result.get("rows", [])
                                                       if not r["method"].startswith(("vllm_", "hf"))])
                   for kind, result in info["drafter_types"]]
        lines += ["", "### Drafter types side by side", "",
                  "Each type trained on the same data and benched on the same prompts (`bench-<type>/`); speed-up "
                  "over the plain decoding above, at the same T.", "",
                  *side_by_side_markdown(side_by_side(bench.get("rows", []), sources))]
    return lines


def _section_served_by_vllm(info: dict[str, Any]) -> list[str]:
    """The real vLLM's figures when the bench ran with engine=vllm (nothing otherwise)."""
    bench = info["bench"] or {}
    if (bench.get("config") or {}).get("engine") != "vllm":
        return []
    lines = ["", "## Served by vLLM", ""]
    rows = [r for r in bench.get("rows", []) if r.get("engine") == "vllm"]
    failed = [r for r in rows if "error" in r]
    if failed or not rows:
        return lines + [f"vLLM did not finish: {(failed[0]['error'] if failed else 'no vLLM rows in bench.json')}"]
    vllm = bench.get("vllm") or {}
    eagle = next((r for r in rows if r["method"] in VLLM_DRAFTER_ROWS and r["temperature"] == 0), {})
    chain = next((r for r in bench.get("rows", []) if r["method"] == "chain" and r["temperature"] == 0), None)
    lines.append(f"vLLM {vllm.get('version')} (`{vllm.get('python')}`) ran the target with and without "
                 f"the exported drafter on the same prompt ids (T=0, fp32): tau {_fmt(eagle.get('tau'), '.3f')}, "
                 "acceptance per position "
                 + " ".join(f"{x:.3f}" for x in eagle.get("acceptance_per_position", [])) + " (vLLM's own counters)"
                 + (f"; eaglekit's chain: tau {_fmt(chain.get('tau'), '.3f')}." if chain and "tau" in chain else "."))
    return lines + vllm_checks_markdown(rows)


def _served_target(info: dict[str, Any]) -> str:
    """The target as an engine must be given it: the built-in 'tiny' and relative paths become absolute."""
    target = (info["run"].get("config") or {}).get("target", "TARGET")
    if target == "tiny":
        from eaglekit.targets.loading import tiny_target_path

        return str(tiny_target_path())
    return str(Path(target).resolve()) if Path(target).exists() else target


def served_by_vllm(drafter: str) -> dict[str, Any]:
    """vLLM's --speculative-config for the export in folder `drafter`, from its drafter type (an EAGLE-3 drafter's
    where the folder is not there to read)."""
    from eaglekit import registry

    path = Path(drafter) / "config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    kind = registry.checkpoint_type(data) or registry.get("eagle3")
    return kind.vllm_speculative_config(data, drafter)


def launch_commands(target: str, drafter: str, fmt: str, trust_remote_code: bool = False) -> list[str]:
    """The exact command that serves `target` with the exported drafter in `fmt`'s engine."""
    from eaglekit.registry import SERVED_DRAFTS as steps

    trust = " --trust-remote-code" if trust_remote_code else ""
    if fmt == "vllm":
        spec = json.dumps(served_by_vllm(drafter))
        return [f"vllm serve {shlex.quote(target)}{trust} --speculative-config {shlex.quote(spec)}"]
    if fmt == "sglang":
        return [f"python -m sglang.launch_server --model-path {shlex.quote(target)}{trust} "
                f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(drafter)} "
                f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {steps + 1}"]
    if fmt == "speculators":  # the checkpoint names its verifier; the long form names the target explicitly
        spec = json.dumps(served_by_vllm(drafter))
        return [f"vllm serve {shlex.quote(drafter)}{trust}",
                f"vllm serve {shlex.quote(target)}{trust} --speculative-config {shlex.quote(spec)}"]
    return []


def _refusal_note(info: dict[str, Any], fmt: str) -> list[str]:
    """A line above a launch command that the run's doctor says the engine refuses as it is installed."""
    engine = "sglang" if fmt == "sglang" else "vllm"
    report = (info["doctor"] or {}).get(engine) or {}
    if report.get("verdict") != "not supported":
        return []
    return [f"The doctor says {engine} {report.get('engine_version') or ''} will not serve this target with an "
            "EAGLE-3 drafter as installed (see Serving engines below): this command runs once its fix is applied.",
            ""]


def _section_export(info: dict[str, Any]) -> list[str]:
    lines = ["", "## Export", ""]
    if not info["exports"]:
        return lines + ["Not run or not finished (no export/*/manifest.json)."]
    target = _served_target(info)
    trust = bool((info["run"].get("config") or {}).get("trust_remote_code"))
    for fmt, manifest in info["exports"].items():
        drafter = str((info["out"] / "export" / fmt).resolve())
        summary = manifest.get("summary") or {}
        lines += [f"- **{fmt}**: `{drafter}` (aux layer ids as written: {summary.get('config_aux_layer_ids')}; "
                  f"re-import max logit difference {_fmt(summary.get('max_logit_difference'), '.2g')})", ""]
        lines += _refusal_note(info, fmt)
        lines += ["```bash", *launch_commands(target, drafter, fmt, trust), "```", ""]
    return lines


def _section_doctor(info: dict[str, Any]) -> list[str]:
    lines = ["", "## Serving engines (doctor)", ""]
    if not info["doctor"]:
        return lines + ["Not run (no doctor/*/doctor.json)."]
    lines += ["| engine | version | verdict | why | fix |", "|---|---|---|---|---|"]
    for engine, report in info["doctor"].items():
        report = report or {}
        reasons = report.get("reasons") or []
        fix = report.get("fix") or []
        cell = lambda items: "; ".join(str(i) for i in items).replace("|", "\\|") or "-"  # noqa: E731
        lines.append(f"| {engine} | {report.get('engine_version') or 'n/a'} | **{report.get('verdict', 'unknown')}** | "
                     f"{cell(reasons)} | {cell(fix)} |")
    return lines


def write_report(out: str | Path) -> Report:
    """Write `out/report.md` and its plots from what the stages left in `out`."""
    out = Path(out)
    info = collect(out)
    val = ((info["train"] or {}).get("val") or {})
    plots = []
    trained = plot_training(info["metrics"], out / TRAINING_PLOT)
    if trained:
        plots.append(out / TRAINING_PLOT)
    accepted = plot_acceptance((info["bench"] or {}).get("rows", []), val, out / ACCEPTANCE_PLOT)
    if accepted:
        plots.append(out / ACCEPTANCE_PLOT)
    numbers = headline(info)
    from eaglekit.report.notes import headline_notes

    lines = _section_steps(info) + ["", f"**Headline:** {headline_text(numbers)}."]
    lines += [item for note in headline_notes(numbers, info, _served_target(info)) for item in ("", note)]
    lines += _section_data(info) + _section_training(info, trained) + confidence.section(info)
    lines += _section_decoding(info, accepted)
    lines += _section_served_by_vllm(info) + _section_export(info) + _section_doctor(info)
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return Report(path, numbers, plots)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
