"""Runs inside vLLM's own Python (stdlib + vllm only): reads a JSON job, writes a JSON result.

    VLLM_PYTHON vllm_worker.py JOB.json RESULT.json

eaglekit never imports vLLM: vLLM pins its own torch/transformers, so it lives in a venv of its own,
and `eaglekit.vllm.engine` starts this file there as a subprocess. Job kinds (`job["kind"]`):

- `version`: `{"vllm": vllm.__version__}`.
- `generate`: for each entry of `job["runs"]` (`name`, `model`, `speculative_config` or null,
  `prompts` (lists of token ids), `max_new_tokens`, `engine_args`), build one offline `vllm.LLM`, generate
  greedily (T=0) from the token ids, and report each prompt's output ids, the wall time of the
  `generate` call and vLLM's spec-decode counters from `LLM.get_metrics()`. Each entry of the run's
  optional `sampled` (`temperature`, `samples_per_prompt`, `sample_tokens`) then runs on the same engine:
  the prompts sampled at that temperature (wall time, new tokens, counters), and `samples_per_prompt`
  unseeded samples of every prompt, `sample_tokens` tokens each with EOS ignored (`samples`: their ids, for
  a test of the output distribution). A run that fails keeps its error (the exception's own text) and the
  next run still goes.
- `supports_eagle3`: for each architecture in `job["architectures"]`, the class vLLM's registry
  resolves (general plugins loaded first, as vLLM does) and `supports_eagle3(cls)` of vLLM's interfaces.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller), so an
engine error surfaces here as the exception vLLM raised, not as a dead child process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

from vllm_worker_common import error_text

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict:
    """vLLM's spec-decode counters (summed over label sets) from `LLM.get_metrics()`."""
    found: dict = {}
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            key = metric.name.split(":", 1)[1]
            found[key] = found.get(key, 0) + int(metric.value)
        elif metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            previous = found.get("spec_decode_num_accepted_tokens_per_pos", [0] * len(values))
            found["spec_decode_num_accepted_tokens_per_pos"] = [a + b for a, b in zip(previous, values)]
    return found


def timed(llm, prompts: list, params) -> dict:
    """One `generate` call: wall time, each prompt's output ids, new tokens, and the counters it moved."""
    before = spec_counters(llm.get_metrics())
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = spec_counters(llm.get_metrics())
    counters = {}
    for key, value in after.items():
        base = before.get(key, [0] * len(value) if isinstance(value, list) else 0)
        counters[key] = [a - b for a, b in zip(value, base)] if isinstance(value, list) else value - base
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"seconds": seconds, "output_ids": tokens, "new_tokens": sum(len(t) for t in tokens), "counters": counters}


def generate_one(run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(run.get("engine_args") or {})
    if run.get("speculative_config"):
        args["speculative_config"] = run["speculative_config"]
    llm = LLM(model=run["model"], disable_log_stats=False, **args)
    try:
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in run["prompts"]]
        if run.get("warmup", True):  # one short untimed request: first-call costs stay out of the timing
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        result = {"name": run["name"],
                  **timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=run["max_new_tokens"], seed=0))}
        sampled = []
        for spec in run.get("sampled") or []:
            params = SamplingParams(temperature=spec["temperature"], max_tokens=run["max_new_tokens"], seed=0)
            found = timed(llm, prompts, params)
            del found["output_ids"]
            copies = [p for p in prompts for _ in range(spec["samples_per_prompt"])]  # unseeded: each one a draw
            params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["sample_tokens"], ignore_eos=True)
            found["samples"] = [list(o.outputs[0].token_ids) for o in llm.generate(copies, params, use_tqdm=False)]
            sampled.append({"temperature": spec["temperature"], **found})
        if sampled:
            result["sampled"] = sampled
    finally:
        shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        del llm
        gc.collect()
    return result


def run_generate(job: dict) -> dict:
    results = []
    for run in job["runs"]:
        try:
            results.append(generate_one(run))
        except Exception as error:  # noqa: BLE001 - the engine's own refusal is the result to report
            traceback.print_exc()
            results.append({"name": run["name"], "error": error_text(error)})
    return {"runs": results}


def run_supports_eagle3(job: dict) -> dict:
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    verdicts = {}
    for architecture in job["architectures"]:
        try:
            cls = ModelRegistry._try_load_model_cls(architecture)
        except Exception as error:  # noqa: BLE001 - a class that cannot import here is a fact to report
            verdicts[architecture] = {"imports": False, "error": error_text(error)}
            continue
        if cls is None:
            verdicts[architecture] = {"imports": False, "error": "not registered or failed to import"}
            continue
        verdicts[architecture] = {"imports": True, "class": f"{cls.__module__}.{cls.__qualname__}",
                                  "supports_eagle3": bool(supports_eagle3(cls))}
    return {"architectures": verdicts}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_worker.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as handle:
        job = json.load(handle)
    import vllm

    result: dict = {"vllm": vllm.__version__}
    if job["kind"] == "generate":
        result.update(run_generate(job))
    elif job["kind"] == "supports_eagle3":
        result.update(run_supports_eagle3(job))
    elif job["kind"] != "version":
        print(f"unknown job kind {job['kind']!r}", file=sys.stderr)
        return 2
    temporary = argv[2] + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(result, handle)
    os.replace(temporary, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
