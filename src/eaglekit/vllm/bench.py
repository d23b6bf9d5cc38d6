"""`eaglekit bench ... engine=vllm`: the same prompts through the real vLLM, with and without the drafter.

Two measurements in fp32:
- offline (`vllm.LLM` in vLLM's own Python, all prompts in one `generate` call), at T=0 and at every other
  temperature asked for: vLLM's spec-decode counters give tau and acceptance per position. At T=0 the output
  ids show whether speculative decoding kept vLLM's own greedy output; at T > 0, samples of every prompt
  with and without the drafter show whether it kept vLLM's own output distribution (`distribution.compare`);
- served (`vllm serve` on 127.0.0.1, T=0): output tokens/s at each concurrency of the sweep (1, 4, 16
  requests in flight), with the server's counters over the same requests.
The rows (`vllm_plain`, and `vllm_eagle3` or, for a DFlash drafter, `vllm_dflash` (vLLM's `"method": "dflash"`),
one pair per temperature) go into bench.json beside eaglekit's own
methods; at T=0 their `tokens_per_second` is the served figure at concurrency 1 (one request at a time, as
eaglekit's rows), at T > 0 the offline batch's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError
from eaglekit.vllm import engine as ve
from eaglekit.vllm.support import doctor_advice

log = logging.getLogger(__name__)

PLAIN, EAGLE3 = "vllm_plain", "vllm_eagle3"  # rows of plain decoding; with a drafter: vllm_<vLLM's method>


def served_method(drafter_dir: str) -> str:
    """The vLLM speculative method that serves a saved eaglekit drafter (its type's `vllm_method`: eagle3 for EAGLE-3
    and P-EAGLE, served as eagle3 with parallel drafting; dflash for DFlash)."""
    from eaglekit import registry
    from eaglekit.formats.saved import saved_drafter_type

    kind = registry.get(saved_drafter_type(drafter_dir))
    if not kind.vllm_method:
        raise EaglekitError(f"vLLM serves no {kind.name} drafter: leave engine=vllm out for {drafter_dir}")
    return kind.vllm_method


def speculative_row(drafter_dir: str) -> str:
    """The bench row of the run with a saved drafter, named by the method vLLM serves it with (`vllm_eagle3`,
    `vllm_dflash`)."""
    return f"vllm_{served_method(drafter_dir)}"


def export_for_vllm(drafter_dir: str, output: Path, speculative_tokens: int) -> Path:
    """The eaglekit drafter written in vLLM's layout of its type (fp32, verified by re-import) under `output`."""
    import torch

    from eaglekit import registry
    from eaglekit.formats.saved import load_saved_drafter

    drafter = load_saved_drafter(drafter_dir)
    kind = registry.of(drafter)
    kind.check_drafts(drafter.config, speculative_tokens)  # vLLM would draft past what the drafter was trained for
    kind.export(drafter, output, "vllm", dtype=torch.float32, speculative_tokens=speculative_tokens)
    return output


def model_length(prompts: list[list[int]], max_new_tokens: int, speculative_tokens: int) -> int:
    longest = max(len(p) for p in prompts) + max_new_tokens + speculative_tokens + 16
    return -(-longest // 64) * 64  # (rounded up to 64)


def engine_error(run: dict[str, Any], engine: ve.Engine, target: str, log_path: Path) -> EaglekitError:
    """A vLLM refusal as one line: the engine's own words, and the fix the doctor gives for this target."""
    return EaglekitError(f"vLLM {engine.version} rejected run {run['name']}: {run['error'][:400]}; "
                         f"{doctor_advice(engine, target)} (log: {log_path})")


def sample_specs(temperatures: tuple[float, ...], samples: int, num_prompts: int,
                 speculative_tokens: int) -> list[dict[str, Any]]:
    """The worker's `sampled` entries: each temperature above 0, about `samples` draws in all (the same number
    of each prompt) of the first speculative step's tokens (the prefill's, then up to k drafts and the bonus)."""
    per_prompt = max(1, -(-samples // num_prompts))
    return [{"temperature": t, "samples_per_prompt": per_prompt, "sample_tokens": speculative_tokens + 2}
            for t in dict.fromkeys(temperatures) if t > 0]


def offline(engine: ve.Engine, target: str, drafter: Path, prompts: list[list[int]], max_new_tokens: int,
            speculative_tokens: int, workdir: Path, sampled: list[dict[str, Any]] = (),
            method: str = "eagle3") -> dict[str, dict[str, Any]]:
    """Both offline runs in one worker process -> {name: worker result} (raises on a refusal)."""
    args = ve.engine_args(model_length(prompts, max_new_tokens, speculative_tokens), target, engine.device_type)
    runs = [{"name": PLAIN, "model": target, "speculative_config": None},
            {"name": f"vllm_{method}", "model": target,
             "speculative_config": ve.speculative_config(drafter, speculative_tokens, engine.device_type, method)}]
    job = {"kind": "generate", "runs": [{**r, "prompts": prompts, "max_new_tokens": max_new_tokens, "engine_args": args,
                                         "sampled": list(sampled)} for r in runs]}
    result = ve.run_worker(engine, job, workdir, "offline")
    for run in result["runs"]:
        if "error" in run:
            raise engine_error(run, engine, target, workdir / "offline.log")
    return {r["name"]: r for r in result["runs"]}


def _complete(client: Any, server: ve.Server, ids: list[int], max_new_tokens: int) -> int:
    """One greedy completion from token ids; its number of new tokens."""
    body = {"model": server.model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
    response = client.post(f"{server.url}/v1/completions", json=body)
    if response.status_code != 200:
        server.check_alive("answering a completion")
        raise EaglekitError(f"the vLLM server answered {response.status_code}: {response.text[:300]}")
    return int(response.json()["usage"]["completion_tokens"])


def sweep(server: ve.Server, prompts: list[list[int]], max_new_tokens: int, levels: tuple[int, ...],
          request_timeout: float) -> list[dict[str, Any]]:
    """Output tokens/s with `c` requests in flight, for each c in `levels` (at least c requests per level)."""
    import httpx

    results = []
    with httpx.Client(timeout=request_timeout) as client:
        _complete(client, server, prompts[0], 2)  # warm-up, untimed
        for level in levels:
            requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), level))]
            before = server.metrics()
            start = time.perf_counter()
            try:
                with ThreadPoolExecutor(max_workers=level) as pool:
                    tokens = sum(pool.map(lambda ids: _complete(client, server, ids, max_new_tokens), requests))
            except httpx.HTTPError as error:
                server.check_alive(f"serving concurrency {level}")
                raise EaglekitError(f"a request to the vLLM server failed at concurrency {level}: {error}") from None
            seconds = time.perf_counter() - start
            level_result = {"concurrency": level, "requests": len(requests), "new_tokens": tokens, "seconds": seconds,
                            "tokens_per_second": tokens / seconds if seconds else None}
            figures = ve.acceptance(ve.counter_delta(server.metrics(), before))
            level_result.update({k: v for k, v in figures.items() if k in ("tau", "acceptance_per_position", "drafts")})
            results.append(level_result)
            log.info("vLLM %s concurrency %d: %.1f tokens/s", server.model, level,
                     level_result["tokens_per_second"] or 0)
    return results


def served(engine: ve.Engine, target: str, drafter: Path, prompts: list[list[int]], max_new_tokens: int,
           speculative_tokens: int, levels: tuple[int, ...], workdir: Path, startup_timeout: float,
           request_timeout: float, method: str = "eagle3") -> dict[str, list[dict[str, Any]]]:
    """The concurrency sweep on a `vllm serve` without, then with, the drafter -> {name: levels}."""
    args = ve.engine_args(model_length(prompts, max_new_tokens, speculative_tokens), target, engine.device_type)
    found = {}
    spec_config = ve.speculative_config(drafter, speculative_tokens, engine.device_type, method)
    for name, spec in ((PLAIN, None), (f"vllm_{method}", spec_config)):
        with ve.serving(engine, target, args, spec, workdir / f"serve_{name}.log", startup_timeout) as server:
            found[name] = sweep(server, prompts, max_new_tokens, levels, request_timeout)
    return found


def rows(engine: ve.Engine, offline_runs: dict[str, dict[str, Any]], sweeps: dict[str, list[dict[str, Any]]],
         num_prompts: int, method: str = "eagle3") -> list[dict[str, Any]]:
    """bench.json rows for vLLM: offline counters and outputs, the sweep, and the concurrency-1 speed."""
    plain_ids = offline_runs[PLAIN]["output_ids"]
    speculative = f"vllm_{method}"
    table = []
    for name in (PLAIN, speculative):
        run, levels = offline_runs[name], sweeps.get(name, [])
        first = next((level for level in levels if level["concurrency"] == 1), None)
        tokens_per_second = first["tokens_per_second"] if first else run["new_tokens"] / run["seconds"]
        row: dict[str, Any] = {
            "method": name, "temperature": 0.0, "engine": "vllm", "engine_version": engine.version,
            "new_tokens": run["new_tokens"], "tokens_per_second": tokens_per_second,
            "ms_per_token": 1000 / tokens_per_second if tokens_per_second else None,
            "speed_from": "served, concurrency 1" if first else f"offline, {num_prompts} prompts in one batch",
            "offline": {"seconds": run["seconds"], "new_tokens": run["new_tokens"], "batch": num_prompts,
                        "tokens_per_second": run["new_tokens"] / run["seconds"] if run["seconds"] else None},
            "concurrency": levels,
            "outputs_equal_plain": sum(a == b for a, b in zip(run["output_ids"], plain_ids)) / max(len(plain_ids), 1)}
        if name == speculative:
            row.update(_counted(run["counters"]))
        table.append(row)
    return table + sampled_rows(engine, offline_runs, num_prompts, speculative)


def _counted(counters: dict[str, Any]) -> dict[str, Any]:
    """tau and acceptance from vLLM's counters of a run with the drafter (raises when it counted nothing)."""
    figures = ve.acceptance(counters)
    if not figures.get("drafts"):
        raise EaglekitError("vLLM ran the drafter but counted no drafts; its spec-decode counters are missing "
                            "(disable_log_stats must be off): see the offline log")
    return {k: figures[k] for k in ("tau", "acceptance_per_position", "drafts", "accepted_per_position")}


def sampled_rows(engine: ve.Engine, offline_runs: dict[str, dict[str, Any]], num_prompts: int,
                 speculative: str = EAGLE3) -> list[dict[str, Any]]:
    """The rows at each temperature above 0: offline speed, vLLM's tau, and whether the drafter kept vLLM's own
    output distribution (a warning when it did not: the tau such an engine counts is no acceptance of the target's
    samples)."""
    from eaglekit.vllm.distribution import compare

    table = []
    plain_runs = {s["temperature"]: s for s in offline_runs[PLAIN].get("sampled", [])}
    for found in offline_runs[speculative].get("sampled", []):
        temperature = found["temperature"]
        for name, run in ((PLAIN, plain_runs[temperature]), (speculative, found)):
            speed = run["new_tokens"] / run["seconds"] if run["seconds"] else None
            row: dict[str, Any] = {
                "method": name, "temperature": temperature, "engine": "vllm", "engine_version": engine.version,
                "new_tokens": run["new_tokens"], "tokens_per_second": speed,
                "ms_per_token": 1000 / speed if speed else None,
                "speed_from": f"offline, {num_prompts} prompts in one batch"}
            if name == speculative:
                row.update(_counted(run["counters"]))
                row["distribution"] = check = compare(plain_runs[temperature]["samples"], run["samples"])
                if not check["matches_plain"]:
                    log.warning("vLLM %s at T=%g: the output with the drafter does not follow vLLM's own output "
                                "distribution (p = %.2g over %d samples x %d positions): this engine's speculative "
                                "sampling is not lossless here", engine.version, temperature, check["p_value"],
                                check["samples"][1], check["positions"])
            table.append(row)
    return table


def measure(engine: ve.Engine, target: str, drafter_dir: str, prompts: list[list[int]], output: Path, *,
            max_new_tokens: int, speculative_tokens: int, levels: tuple[int, ...], temperatures: tuple[float, ...] = (),
            samples: int = 400, startup_timeout: float = 600.0, request_timeout: float = 600.0) -> list[dict[str, Any]]:
    """Export, run offline (T=0 and `temperatures` above 0, `samples` draws each for the distribution check) and
    served, and return the vLLM rows (work files under `output/vllm/`)."""
    if not Path(target).is_dir():  # `target.loading.local_model_dir` gives a hub id's cached snapshot
        raise EaglekitError("engine=vllm needs the target as a local model directory (vLLM loads "
                            f"it); {target} is not one")
    workdir = output / "vllm"
    method = served_method(drafter_dir)
    drafter = export_for_vllm(drafter_dir, workdir / "drafter", speculative_tokens)
    log.info("vLLM %s (%s): offline runs", engine.version, engine.python)
    offline_runs = offline(engine, target, drafter, prompts, max_new_tokens, speculative_tokens, workdir,
                           sample_specs(temperatures, samples, len(prompts), speculative_tokens), method)
    sweeps = served(engine, target, drafter, prompts, max_new_tokens, speculative_tokens, levels, workdir,
                    startup_timeout, request_timeout, method) if levels else {}
    return rows(engine, offline_runs, sweeps, len(prompts), method)
