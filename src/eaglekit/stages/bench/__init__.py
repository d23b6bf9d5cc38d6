"""Benchmark decoding methods on a prompt file: tau, acceptance per position, tokens/s, time per token.

    eaglekit bench mtbench.jsonl --target meta-llama/Llama-3.1-8B-Instruct --drafter runs/train/final
    eaglekit bench mtbench.jsonl target=... drafter=... assistant=meta-llama/Llama-3.2-1B-Instruct output=runs/bench

Methods (`methods=`): plain (eaglekit's own plain decoding, fast path when the target allows), hf
(`model.generate`), hf_assisted (HF assisted generation with `assistant=`, skipped without one),
hf_prompt_lookup (HF prompt-lookup decoding), chain and tree (eaglekit EAGLE-3; left at the default, the drafting
methods are the drafter's own: dflash for a DFlash drafter, parallel, chain and tree for P-EAGLE). Each runs at every
temperature in `temperatures=`. Before timing, the HF methods run the first `warmup` prompts once
untimed and eaglekit's methods every prompt (warmup=0: none). Then the methods run interleaved: prompt by
prompt, every method back to back in a rotating order, `repeats` passes over the prompts; figures are medians
over the passes with their spread, and speed-ups are paired with plain decoding's in the same pass
(eaglekit.stages.bench.timing). A T=0 speed-up above tau, or a spread that reaches plain's 1x, is flagged and
measured again (`remeasure=` more rounds at most); one still flagged is reported as not measurable. Writes
bench.json, bench.md and bench.png to `output`.

`engine=vllm` adds the real vLLM's figures on the same prompt ids (rows `vllm_plain`, `vllm_eagle3` at T=0 and
at each temperature above 0): tau and acceptance per position from vLLM's own spec-decode counters, whether the
drafter kept vLLM's own output (T=0: the same ids; T > 0: the same distribution), and output tokens/s of
`vllm serve` at each concurrency of `concurrency=` (eaglekit.vllm.bench). vLLM runs in its own Python
(`vllm_python=`, default: this one when it imports vllm, else .venv-vllm/bin/python from `make vllm-env`).

    eaglekit bench tiny-eval target=tiny drafter=runs/demo/train engine=vllm methods=chain chain_length=3
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit import registry
from eaglekit.config import check_options, option, save_resolved, to_dict
from eaglekit.config.decode import DRAFT_TOPK, DecodeOptions
from eaglekit.errors import EaglekitError
from eaglekit.stages.bench.measure import (DRAFTER_METHODS, _Runner, cut_label, measure_temperature, row_label,
                                           takes_draft_topk)

log = logging.getLogger(__name__)

POSITIONAL = ("prompts",)
DEFAULT_METHODS = ("plain", "hf", "hf_assisted", "hf_prompt_lookup", "chain", "tree")
NO_ASSISTANT = ("no assistant= given: HF assisted generation needs a small draft model with the target's tokenizer "
                "(assistant=MODEL)")
ALL_METHODS = tuple(dict.fromkeys((*DEFAULT_METHODS, *DRAFTER_METHODS)))


@dataclass(frozen=True)
class Config:
    target: str = option("", "target model directory, hub id or 'tiny'")
    drafter: str = option("", "eaglekit drafter directory (for chain and tree)")
    prompts: str = option("", "prompt file: JSONL/JSON conversations (OpenAI messages, ShareGPT, prompt/completion)")
    skip_errors: bool = option(False, "skip malformed records of the prompt file (counted) instead of stopping")
    output: str = option("runs/bench", "directory for bench.json, bench.md, bench.png")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by bench")
    methods: tuple[str, ...] = option(DEFAULT_METHODS, "methods to measure (subset of: " + ", ".join(ALL_METHODS) +
                                      "; each drafting method needs a drafter of a type that drafts with it: " +
                                      ", ".join(f"{m} {'/'.join(registry.types_drafting(m))}" for m in DRAFTER_METHODS)
                                      + ")")
    temperatures: tuple[float, ...] = option((0.0, 1.0), "temperatures to measure at", min=0)
    num_prompts: int = option(0, "use the first N prompts (0 = all)", min=0)
    max_new_tokens: int = option(128, "tokens generated per prompt", min=1)
    repeats: int = option(3, "timed passes over the prompts, every method back to back on each prompt in a rotating "
                             "order (figures: median and min-max spread over the passes)", min=1)
    remeasure: int = option(2, "extra rounds of `repeats` passes at a temperature whose figures are flagged (a T=0 "
                               "speed-up above tau, a spread that reaches plain's 1x); still flagged after them: "
                               "reported as not measurable", min=0)
    warmup: int = option(1, "HF methods: prompts run once untimed before timing; eaglekit's methods warm up on "
                            "all (0 = no warm-up)", min=0)
    assistant: str = option("", "small draft model (same tokenizer) for HF assisted generation")
    prompt_lookup_num_tokens: int = option(10, "HF prompt lookup: tokens proposed per step", min=1)
    depth: int = option(DecodeOptions.depth, "tree: draft levels", min=1)
    tree_top_k: int = option(DecodeOptions.tree_top_k, "tree: children per node and nodes expanded per level", min=1)
    total_tokens: int = option(DecodeOptions.total_tokens, "tree: draft nodes verified per target forward", min=1)
    chain_length: int = option(DecodeOptions.chain_length, "chain, parallel, dflash, dspark: draft tokens per target "
                               "forward", min=1)
    draft_topk: int = option(0, DRAFT_TOPK, min=0)
    verify_thresholds: tuple[float, ...] = option((), "a method with a confidence cut (dspark): also measure it at "
                                                  "each of these verify_threshold values (its rows: drafts verified "
                                                  "per step and the accepted share of them; 0 = every draft)",
                                                  min=0, max=1)
    backend: str = option("auto", "eaglekit backend: auto, eager or static", choices=("auto", "eager", "static"))
    compile: bool = option(True, "torch.compile + CUDA graphs for eaglekit's fixed-shape static-backend steps (GPU "
                                 "only; ignored on CPU)")
    seed: int = option(0, "sampling seed", min=0)
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1)")
    dtype: str = option("auto", "dtype (auto = bf16 on GPU, fp32 on CPU)")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")
    engine: str = option("eaglekit", "eaglekit: eaglekit's own methods only; vllm: also the real vLLM with and without "
                         "the drafter (chain of chain_length drafts)", choices=("eaglekit", "vllm"))
    vllm_python: str = option("", "engine=vllm: a Python with vLLM (default: this one if it imports vllm, else "
                                  ".venv-vllm/bin/python)")
    concurrency: tuple[int, ...] = option((1, 4, 16),
                                          "engine=vllm: requests in flight for the served sweep (empty: offline only)",
                                          min=1)
    vllm_samples: int = option(400, "engine=vllm, T > 0: samples of the prompts with and without the drafter whose "
                                    "first tokens are compared (is vLLM's speculative sampling lossless?)", min=1)
    vllm_version_check: bool = option(True, "engine=vllm: refuse a vLLM other than the tested 0.32.0")
    vllm_startup_timeout: float = option(600.0, "engine=vllm: seconds to wait for `vllm serve` to answer /health",
                                         above=0)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from eaglekit.extras import pyplot
    from eaglekit.manifest import atomic_path

    plt = pyplot(path.name)
    if plt is None:
        return

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    failed = [f"{r['method']} T={r['temperature']:g}" for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    if not rows:  # every method failed: no blank chart (bench.md and the error line name the failures)
        plt.close(fig)
        path.unlink(missing_ok=True)
        return
    if failed:
        fig.suptitle(f"failed, not shown: {', '.join(failed)} (see bench.md)", color="tab:red", fontsize=9)
    for row in rows:
        if "acceptance_per_position" in row:
            rates = row["acceptance_per_position"]
            left.plot(range(1, len(rates) + 1), rates, marker="o",
                      label=f"{row['method']} T={row['temperature']:g} (tau {row['tau']:.2f})")
    left.set(xlabel="draft position", ylabel="accepted fraction of steps", title="acceptance per position",
             ylim=(0, 1.05))
    left.xaxis.get_major_locator().set_params(integer=True)  # positions are whole numbers
    if left.get_legend_handles_labels()[0]:  # no drafting method measured: no empty legend
        left.legend(fontsize=8)
    labels = [f"{r['method']}\nT={r['temperature']:g}" for r in rows]
    speeds = [r.get("tokens_per_second") or 0 for r in rows]
    spreads = [r.get("tokens_per_second_spread") or [speed, speed] for r, speed in zip(rows, speeds)]
    errors = [[speed - low for speed, (low, _) in zip(speeds, spreads)],
              [high - speed for speed, (_, high) in zip(speeds, spreads)]]
    right.bar(range(len(rows)), speeds, yerr=errors, capsize=3, color="tab:blue")
    right.set_xticks(range(len(rows)), labels, fontsize=7)
    right.set(ylabel="tokens / s", title="decoding speed (median of repeats, bars: min-max)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def row_summary(row: dict[str, Any]) -> str:
    """One readable line for a bench row (bench.json keeps every field): method, T, tau, speed, acceptance."""
    head = f"bench: {row_label(row)} at T={row['temperature']:g}"
    if "error" in row:
        return f"{head} failed: {row['error']}"
    parts = [f"tau {row['tau']:.2f}"] if "tau" in row else []
    if row.get("tokens_per_second"):
        parts.append(f"{row['tokens_per_second']:.1f} tokens/s ({row['ms_per_token']:.1f} ms/token)")
    if row.get("acceptance_per_position"):
        parts.append("acceptance per position " + " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]))
    if "verified_per_step" in row:
        parts.append(f"{row['verified_per_step']:.2f} drafts verified per step, "
                     f"{row['accepted_of_verified'] or 0:.2f} of them accepted")
    if row.get("speedup") and row.get("baseline") not in (None, row["method"]):
        low, high = row.get("speedup_spread") or (row["speedup"], row["speedup"])
        parts.append(f"speed-up {row['speedup']:.2f}x vs {row['baseline']}"
                     + (f" ({low:.2f}-{high:.2f} over {row['repeats']} repeats)" if row.get("repeats", 1) > 1 else "")
                     + (f", NOT MEASURABLE here: {', '.join(row['flags'])}" if row.get("flags") else ""))
    return f"{head}: " + (", ".join(parts) or "no tokens generated")


def _table(rows: list[dict[str, Any]], skipped: list[dict[str, str]]) -> str:
    from eaglekit.report import bench_markdown, bench_notes, vllm_checks_markdown
    from eaglekit.report.bench import confidence_markdown

    return "\n".join(bench_markdown(rows) + confidence_markdown(rows) + bench_notes(rows, skipped)
                     + vllm_checks_markdown(rows)) + "\n"


def skipped_methods(config: Config) -> list[dict[str, str]]:
    """Methods asked for that bench leaves out, with the reason (bench.json's `skipped`, a line under the table)."""
    return [{"method": "hf_assisted", "reason": NO_ASSISTANT}] if "hf_assisted" in config.methods \
        and not config.assistant else []


def _check(config: Config) -> list[str]:
    check_options(config)  # each option within its declared range (the CLI's load_config checked them already)
    if not config.target or not config.prompts:
        raise EaglekitError("bench needs target=... and a prompt file: eaglekit bench PROMPTS.jsonl "
                            "target=PATH drafter=DIR")
    unknown = [m for m in config.methods if m not in ALL_METHODS]
    if unknown:
        raise EaglekitError(f"unknown bench methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    methods = [m for m in config.methods if not (m == "hf_assisted" and not config.assistant)]
    if any(m in DRAFTER_METHODS for m in methods) and not config.drafter:
        raise EaglekitError(f"methods {'/'.join(DRAFTER_METHODS)} need drafter=DIR; or leave them out: "
                            "methods=plain,hf,hf_prompt_lookup")
    if config.engine == "vllm" and not config.drafter:
        raise EaglekitError("engine=vllm serves the target with the drafter: pass drafter=DIR")
    if not methods and config.engine != "vllm":
        raise EaglekitError("no methods to measure: pass methods=plain,chain,... (an empty list only with engine=vllm)")
    if config.verify_thresholds:
        cut = [m for m in methods if m in DRAFTER_METHODS and registry.speculative_method(m).confidence]
        if not cut:
            raise EaglekitError(f"verify_thresholds={','.join(f'{t:g}' for t in config.verify_thresholds)} sweeps the "
                                f"confidence cut of a method that has one, and methods={','.join(methods)} has none: "
                                "add method dspark (with a DSpark drafter), or drop verify_thresholds")
    if config.draft_topk and not any(takes_draft_topk(m) for m in methods):
        raise EaglekitError(f"draft_topk={config.draft_topk} sets the candidates of a Markov head's correction, and "
                            f"methods={','.join(methods)} has none: add method dspark (with a DSpark drafter), or "
                            "drop draft_topk")
    return methods


def _own_methods(config: Config) -> Config:
    """Left at the default, the drafting methods are the drafter's type's own (a DFlash drafter: dflash, not chain
    and tree). A drafter whose config cannot be read keeps the default: the checks after refuse it."""
    from eaglekit.formats.saved import saved_drafter_config

    if not config.drafter or config.methods != DEFAULT_METHODS:
        return config
    try:
        own = registry.of_config(saved_drafter_config(config.drafter)).methods
    except EaglekitError:
        return config
    return dataclasses.replace(config, methods=(*(m for m in DEFAULT_METHODS if m not in DRAFTER_METHODS), *own))


def _check_drafter(config: Config, methods: list[str]) -> None:
    """Before anything loads: a drafting method the drafter does not draft with, or an option its config cannot
    draft with (a chain longer than its block, more Markov candidates than draft ids), is one error."""
    from eaglekit.decode.setup import check_request

    for method in methods:
        if method in DRAFTER_METHODS:
            cut = registry.speculative_method(method).confidence and config.verify_thresholds
            check_request(method, config.drafter, chain_length=config.chain_length,
                          draft_topk=config.draft_topk if takes_draft_topk(method) else 0,
                          verify_threshold=max(config.verify_thresholds) if cut else 0.0)


def _labels(config: Config, methods: list[str]) -> list[str]:
    """What bench runs: each method, and a method with a confidence cut once more at each of `verify_thresholds`."""
    labels = []
    for method in methods:
        labels.append(method)
        if method in DRAFTER_METHODS and registry.speculative_method(method).confidence:
            labels += [cut_label(method, t) for t in config.verify_thresholds if t > 0]
    return labels


def _eaglekit_rows(config: Config, methods: list[str], prompts: list[list[int]], tokenizer, result: dict[str, Any],
                   output: Path) -> None:
    """Measure eaglekit's own methods into result["rows"] (bench.json rewritten after each round)."""
    from eaglekit.decode.setup import eos_ids, load_drafter, resolve_backend
    from eaglekit.manifest import atomic_write_json
    from eaglekit.runtime import resolve_device, resolve_dtype
    from eaglekit.targets.loading import load_target

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target = load_target(config.target, device, dtype, config.trust_remote_code)
    drafter = load_drafter(config.drafter, target, device, dtype) if config.drafter else None
    assistant = load_target(config.assistant, device, dtype,
                            config.trust_remote_code) if "hf_assisted" in methods else None
    result["backend"] = backend = resolve_backend(config.backend, target)
    runner = _Runner(config, target, drafter, assistant, tokenizer, eos_ids(tokenizer, target), backend, device,
                     max(len(p) for p in prompts))
    rows = result["rows"]
    for temperature in config.temperatures:
        done = len(rows)

        def save(measured: list[dict[str, Any]]) -> None:  # an interrupted bench keeps the rows measured so far
            rows[done:] = measured
            atomic_write_json(output / "bench.json", result)

        for row in measure_temperature(runner, _labels(config, methods), temperature, prompts, config, save):
            log.info("%s", row_summary(row))


def _vllm_rows(config: Config, engine, prompts: list[list[int]], output: Path) -> list[dict[str, Any]]:
    """The real vLLM's rows; a refusal or a dead server becomes one failed row (eaglekit's rows are kept)."""
    from eaglekit.vllm.bench import EAGLE3, measure, speculative_row
    from eaglekit.targets.loading import local_model_dir

    name = EAGLE3  # the failed row is named as the run it stands for, once the drafter's type is read
    try:
        name = speculative_row(config.drafter)
        return measure(engine, local_model_dir(config.target), config.drafter, prompts, output,
                       max_new_tokens=config.max_new_tokens, speculative_tokens=config.chain_length,
                       levels=config.concurrency, temperatures=config.temperatures, samples=config.vllm_samples,
                       startup_timeout=config.vllm_startup_timeout)
    except EaglekitError as error:
        log.error("bench: vLLM: %s", error)
        return [{"method": name, "temperature": 0.0, "engine": "vllm", "error": str(error)}]


def run(config: Config) -> dict[str, Any]:
    from eaglekit.data import prompt_messages, read_conversations
    from eaglekit.decode.setup import prompt_ids
    from eaglekit.manifest import atomic_write_json, atomic_write_text, claim_output, environment, write_manifest
    from eaglekit.targets.loading import load_tokenizer

    config = _own_methods(config)
    methods = _check(config)  # the options alone (also `eaglekit run`'s pre-flight, before train writes the drafter)
    if config.drafter:
        from eaglekit.decode.setup import check_drafter_path

        check_drafter_path(config.drafter)
    if methods:  # chain/tree on layers they cannot run, backend=static off its models: refused before measuring
        from eaglekit.preflight import check_decoding
        from eaglekit.targets.loading import load_target_config

        check_decoding(load_target_config(config.target, trust_remote_code=config.trust_remote_code), methods,
                       config.backend, config.target)
    if config.drafter:
        _check_drafter(config, methods)
    engine = None
    if config.engine == "vllm":  # vLLM missing or of another version: refused before anything is measured
        from eaglekit.vllm.engine import find_engine

        engine = find_engine(config.vllm_python, config.vllm_version_check)
        from eaglekit.vllm.support import check_served
        from eaglekit.targets.loading import local_model_dir

        check_served(engine, local_model_dir(config.target))
    conversations = read_conversations(config.prompts, skip_errors=config.skip_errors)
    if config.num_prompts:
        conversations = conversations[: config.num_prompts]
    if not conversations:
        raise EaglekitError(f"{config.prompts} holds no conversations")
    tokenizer = load_tokenizer(config.target, config.trust_remote_code)
    prompts = [prompt_ids(tokenizer, prompt_messages(c)) for c in conversations]
    output = claim_output(config.output, "bench", config.overwrite)
    rows: list[dict[str, Any]] = []
    skipped = skipped_methods(config)
    for entry in skipped:
        log.warning("bench: %s skipped: %s", entry["method"], entry["reason"])
    result = {"rows": rows, "skipped": skipped, "backend": None, "num_prompts": len(prompts),
              "schedule": {"repeats": config.repeats, "max_rounds": 1 + config.remeasure, "interleaved": True},
              "config": to_dict(config), "environment": environment(), "complete": False}
    if methods:
        _eaglekit_rows(config, methods, prompts, tokenizer, result, output)
    if engine is not None:
        result["vllm"] = {"python": engine.python, "version": engine.version}
        rows.extend(_vllm_rows(config, engine, prompts, output))
    result["complete"] = True
    atomic_write_json(output / "bench.json", result)
    atomic_write_text(output / "bench.md", _table(rows, skipped))
    _plot(rows, output / "bench.png")
    save_resolved(config, output)
    print(_table(rows, skipped))
    failed = [f"{row_label(r)} T={r['temperature']:g} ({r['error']})" for r in rows if "error" in r]
    if failed:  # no manifest: a re-run must not take this bench for finished
        raise EaglekitError(f"bench: {len(failed)} method(s) failed, the others' figures are in {output}: "
                            + "; ".join(failed))
    write_manifest(output, "bench", {"outputs": ["bench.json", "bench.md", "bench.png"]})
    return result
