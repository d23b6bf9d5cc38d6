"""vLLM's CPU build at T > 0: does its output with a drafter follow its plain output, as shipped and with its
temperature-expanding kernel written as intended?

`eaglekit bench ... engine=vllm temperatures=0,1` finds that vLLM 0.32.0's CPU build does not keep its own output
distribution with a drafter at T > 0. The cause, read in vLLM's source: the rejection sampler divides the target's
logits at the draft positions by each request's temperature, spread over its draft tokens by `expand_batch_to_tokens`;
on the CPU that kernel is `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel an int64 copy
of the float32 output (`_ensure_int64`) and never copies it back, so the temperatures it divides by are the
uninitialised memory of `new_empty`. This script measures both: the same job (the prompts, target, drafter and engine
arguments of a bench's `vllm/offline.job.json`) sampled with and without the drafter, once with vLLM as shipped and
once with that one kernel replaced by the same computation in PyTorch, and the per-position check of
`eaglekit.vllm.distribution` on each. Run it with vLLM's Python, from where the bench ran (the job's drafter path
is relative to it):

    .venv-vllm/bin/python benchmarks/vllm_cpu_temperature.py --job runs/demo/bench-vllm/vllm/offline.job.json \\
        --output X.json

Each variant runs in a process of its own (the kernel table is filled when vLLM's engine starts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("as_shipped", "expand_kernel_fixed")


def expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """What `_expand_kernel_impl` is for: each request's value repeated over its tokens, `replace_from` replaced."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts))


def sample(job: dict, variant: str, temperature: float, per_prompt: int, tokens: int) -> dict:
    """Samples of every prompt without and with the drafter (EOS ignored), and vLLM's spec-decode counters."""
    if variant == "expand_kernel_fixed":
        import vllm.utils.cpu_triton_utils as cpu_kernels

        cpu_kernels._expand_kernel_impl = expand_in_torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    found = {}
    for run in job["runs"]:
        args = dict(run["engine_args"])
        if run.get("speculative_config"):
            args["speculative_config"] = run["speculative_config"]
        llm = LLM(model=run["model"], disable_log_stats=False, **args)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"] for _ in range(per_prompt)]
        params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        counters = {m.name.split(":", 1)[1]: (list(m.values) if hasattr(m, "values") else m.value)
                    for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
        found[run["name"]] = {"samples": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}
        llm.llm_engine.engine_core.shutdown()
        del llm
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, help="a bench's vllm/offline.job.json (prompts, target, drafter)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=400, help="samples of the prompts per run, about")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    per_prompt = max(1, -(-args.samples // len(job["runs"][0]["prompts"])))
    tokens = job["runs"][1]["speculative_config"]["num_speculative_tokens"] + 2  # the prefill's, then one step's
    if args.variant:
        result = sample(job, args.variant, args.temperature, per_prompt, tokens)
        Path(args.output).write_text(json.dumps(result))
        return result
    sys.path.insert(0, str(ROOT / "src"))
    from eaglekit.vllm.distribution import compare
    from eaglekit.manifest import environment

    result = {"benchmark": "vllm_cpu_temperature", "environment": environment(), "job": args.job,
              "temperature": args.temperature, "samples_per_prompt": per_prompt, "tokens": tokens, "variants": {}}
    for variant in VARIANTS:
        part = Path(f"{args.output}.{variant}.tmp")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        subprocess.run([sys.executable, __file__, "--job", args.job, "--output", str(part), "--variant", variant,
                        "--temperature", str(args.temperature), "--samples", str(args.samples)], check=True, env=env)
        runs = json.loads(part.read_text())
        part.unlink()
        plain, eagle = runs["vllm_plain"], runs["vllm_eagle3"]
        counters = eagle["counters"]
        drafts = counters.get("spec_decode_num_drafts") or 0
        result["variants"][variant] = {
            "check": compare(plain["samples"], eagle["samples"]), "drafts": drafts,
            "acceptance_per_position": [a / drafts for a in counters.get("spec_decode_num_accepted_tokens_per_pos", [])]
            if drafts else []}
        print(variant, result["variants"][variant], flush=True)
    import vllm

    result["vllm"] = vllm.__version__
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
