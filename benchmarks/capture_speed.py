"""Hidden-state capture throughput: `extract backend=hf` and `extract backend=vllm` on the same records, and vLLM's
own prefill of the same token ids with capture off (the bound the capture path is measured against).

    python benchmarks/capture_speed.py                               # the tiny target, the 200 shipped prompts
    python benchmarks/capture_speed.py --target DIR --limit 1000 --tensor-parallel-size 8 --out capture.json

"hf" is `eaglekit extract` (hooks on the Hugging Face model in this process); "vllm" is `eaglekit extract
backend=vllm` (vLLM's extract_hidden_states, every request's file read, checked, normed and written into shards),
timed from the engine's start-up being done to the last record stored (start-up is reported apart);
"vllm_prefill" is one `LLM.generate` of the same token ids with one new token each and no speculative method
(the engine alone, nothing captured), with the same engine arguments and as many requests in flight. The goal:
capture >= 85% of that prefill's tokens/s. Writes JSON (environment, config, figures) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.85


def extract_run(backend: str, args: argparse.Namespace, out: Path) -> dict:
    from eaglekit.config import load_config
    from eaglekit.stages import extract

    options = [f"data={args.data}", f"output={out}", f"target={args.target}", f"limit={args.limit}",
               f"max_batch_size={args.max_batch_size}", f"backend={backend}", "overwrite=true"]
    if backend == "vllm":
        options += [f"tensor_parallel_size={args.tensor_parallel_size}", f"vllm_python={args.vllm_python}",
                    f"vllm_engine_args={json.dumps(scheduler_args(args))}"]
    else:
        options += [f"device={args.device}"]
    stats = extract.run(load_config(extract.Config, None, options)).stats
    keys = ("tokens_extracted", "seconds", "tokens_per_second", "engine_startup_seconds", "engine_layer_ids")
    return {"backend": backend, **{k: stats[k] for k in keys if k in stats}}


def scheduler_args(args: argparse.Namespace) -> dict:
    """What both vLLM runs schedule with (the speculative method would otherwise change the defaults)."""
    return {"max_num_seqs": args.max_batch_size, "max_num_batched_tokens": args.batch_tokens}


def prefill_run(args: argparse.Namespace, store: Path, work: Path) -> dict:
    """vLLM alone on the store's token ids: one generate call, one new token per request, nothing captured."""
    from eaglekit.vllm import capture as vc
    from eaglekit.vllm import engine as ve
    from eaglekit.targets.loading import local_model_dir
    from eaglekit.targets.store import HiddenStateDataset

    store_records = HiddenStateDataset(store)
    prompts = [store_records[i]["input_ids"].tolist() for i in range(len(store_records))]
    engine = ve.find_engine(args.vllm_python)
    target = local_model_dir(args.target)
    options = vc.EngineOptions(tensor_parallel_size=args.tensor_parallel_size,
                               engine_args=scheduler_args(args))
    engine_args = vc.engine_arguments(engine, target, options, max(len(p) for p in prompts) + 1, False)
    job = {"kind": "generate", "runs": [{"name": "prefill", "model": target, "speculative_config": None,
                                         "prompts": prompts, "max_new_tokens": 1, "engine_args": engine_args}]}
    env = vc.engine_environment(engine, args.tensor_parallel_size)
    run = ve.run_worker(engine, job, work, "prefill", timeout=3600, env=env)["runs"][0]
    if "error" in run:
        sys.exit(f"vLLM prefill failed: {run['error']}")
    tokens = sum(len(p) for p in prompts)
    return {"backend": "vllm_prefill", "tokens_extracted": tokens, "seconds": round(run["seconds"], 3),
            "tokens_per_second": round(tokens / run["seconds"], 1)}


def markdown(rows: list[dict], ratio: float) -> str:
    lines = ["| path | tokens | seconds | tokens/s | engine start-up s |", "|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['tokens_extracted']} | {r['seconds']} | {r['tokens_per_second']} | "
              f"{r.get('engine_startup_seconds', '')} |" for r in rows]
    return "\n".join(lines) + f"\n\nvLLM capture / vLLM prefill: {ratio:.1%} (goal >= {GOAL:.0%})\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--data", default=str(ROOT / "src/eaglekit/assets/tiny_prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-batch-size", type=int, default=64, help="records in flight (both vLLM runs)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="vLLM's max_num_batched_tokens (both runs)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default="auto", help="the hf backend's device")
    parser.add_argument("--vllm-python", default="")
    parser.add_argument("--out", default="runs/benchmarks/capture_speed.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from eaglekit.vllm import engine as ve
    from eaglekit.manifest import environment

    args = parse_args(argv)
    args.vllm_python = args.vllm_python or ve.default_python() or ""
    work = Path(tempfile.mkdtemp(prefix="capture_speed_"))
    try:
        rows = [extract_run("hf", args, work / "hf"), extract_run("vllm", args, work / "vllm")]
        rows.append(prefill_run(args, work / "hf", work / "prefill"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {r["backend"]: r for r in rows}
    ratio = by["vllm"]["tokens_per_second"] / by["vllm_prefill"]["tokens_per_second"]
    result = {"benchmark": "capture_speed", "goal": f"vllm capture >= {GOAL:.0%} of vllm prefill tokens/s",
              "config": vars(args), "environment": environment(), "vllm": ve.probe(args.vllm_python)[0],
              "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],  # a shared machine's figures are noisy
              "results": rows, "capture_over_prefill": round(ratio, 3), "goal_met": ratio >= GOAL,
              "vllm_over_hf": round(by["vllm"]["tokens_per_second"] / by["hf"]["tokens_per_second"], 3)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, ratio))
    print(markdown(rows, ratio))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
