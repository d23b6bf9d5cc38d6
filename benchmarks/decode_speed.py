"""Plain batch-1 decoding speed: eaglekit's static fast path vs HF `generate` vs the bandwidth bound.

    python benchmarks/decode_speed.py                                          # GPU, 8B-shaped Llama, bf16
    python benchmarks/decode_speed.py --shape reference --output X.json --profile X.txt  # the reference shape, profiled
    python benchmarks/decode_speed.py --smoke                                  # CPU, tiny shapes

The model is an 8B-shaped Llama with random weights (built on the meta device, materialised on the
GPU). The bound is model bytes / measured copy bandwidth (read + write bytes per second of a large
device-to-device copy, measured in the same run). Also measured: the cost of one verify forward over
1..64 new tokens (static path), which is what makes tree verification cheap. Timings exclude warm-up
(and compilation) and are medians of repeats. Goals: fast path >= 3x HF generate, >= 60% of the bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglekit.decode import Decoder  # noqa: E402
from eaglekit.decode.static import StaticTarget  # noqa: E402
from eaglekit.manifest import atomic_write_json, environment  # noqa: E402

SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)
# the shape of run_all's reference target: what its speculative speed-up is measured on
SHAPE_REFERENCE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=8192)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random-weight Llama: meta init, then materialised on `device` (no CPU copy of 16 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # non-persistent buffers
    return model.eval().requires_grad_(False)


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int) -> float:
    """Bytes per second (read + write) of a device-to-device copy."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() / seconds


def random_drafter(model, device: torch.device, dtype: torch.dtype, **fields) -> torch.nn.Module:
    """A random-weight EAGLE-3 drafter of the target's width (what a step costs does not depend on its weights);
    `fields`: `DrafterConfig` fields changed (e.g. drafter_arch="mla" and its dimensions)."""
    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.targets.capture import default_aux_layers

    c = model.config
    config = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, vocab_size=c.vocab_size,
                           draft_vocab_size=min(32000, c.vocab_size), target_hidden_size=c.hidden_size,
                           aux_layer_ids=default_aux_layers(c.num_hidden_layers), rope_parameters=dict(c.rope_parameters),
                           **fields)
    drafter = Eagle3Drafter(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    drafter.set_vocab_mapping(torch.arange(config.draft_vocab_size))
    return drafter


def speculative_step_cost(model, device, dtype, prompt: list[int], new_tokens: int, compile_: bool, repeats: int,
                          profile: dict[str, str] | None = None, methods: tuple[str, ...] = ("chain", "tree"),
                          trace_dir: str = "") -> dict:
    """Milliseconds per speculative step (draft + verify + bookkeeping) with a random drafter of the
    target's width: what a step costs relative to a plain step, i.e. the tau a drafter must beat."""
    drafter = random_drafter(model, device, dtype)
    decoder = Decoder(model, drafter, backend="static", compile=compile_, max_length=len(prompt) + new_tokens + 80)
    out = {}
    shapes = {"chain": {"chain_length": 4}, "tree": {"depth": 6, "tree_top_k": 8, "total_tokens": 48}}
    for method, options in ((m, shapes[m]) for m in methods):
        def run():
            return decoder.generate(prompt, new_tokens, method=method, **options)
        run()  # warm-up / compile
        steps = [run().stats for _ in range(repeats)]
        out[method] = statistics.median(1000 * s.decode_seconds / max(len(s.accepted), 1) for s in steps)
        if profile is not None:
            profile[method] = _profile_table(run, f"{trace_dir}/trace_{method}.json" if trace_dir else "")
    return out


def _profile_table(fn, trace: str = "") -> str:
    """torch.profiler's table (host and device time per op) of one call: where a step's time goes. The
    decode loop labels its phases (`eaglekit.drafters.eagle3`, `.verify_forward`, `.verify_and_sync`, `.keep`,
    `.extend`), so their rows split a speculative step. `trace`: also write a Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)


def compile_counters() -> dict:
    """torch.compile's own counters (graphs captured, recompiles, CUDA-graph skips): a speculative step
    that silently fell back to eager shows up here."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items() if values}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (proves the script runs)")
    parser.add_argument("--output", default="", help="JSON path (default runs/benchmarks/decode_speed.json; "
                        "--smoke: decode_speed_smoke.json in the temporary directory)")
    parser.add_argument("--shape", default="8b", choices=("8b", "reference"), help="8B-shaped Llama, or the reference target's shape")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", default="", help="also write torch.profiler tables of a plain, chain and tree decode here (text)")
    parser.add_argument("--trace-dir", default="", help="with --profile: also write Chrome traces of the chain and tree decodes here")
    parser.add_argument("--methods", default="chain,tree", help="speculative step costs to measure (comma list; '' = none)")
    parser.add_argument("--skip-hf", action="store_true", help="do not time HF generate (its figures become NaN)")
    parser.add_argument("--skip-verify-sweep", action="store_true", help="do not time the eager verify cost per token count")
    parser.add_argument("--no-compile", action="store_true", help="static path without torch.compile")
    args = parser.parse_args(argv)
    args.output = args.output or (str(Path(tempfile.gettempdir()) / "decode_speed_smoke.json") if args.smoke
                                  else "runs/benchmarks/decode_speed.json")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    new_tokens = 16 if args.smoke else args.new_tokens
    compile_ = device.type == "cuda" and not args.no_compile
    shape = SHAPE_SMOKE if args.smoke else SHAPE_8B if args.shape == "8b" else SHAPE_REFERENCE
    model = build_model(shape, device, dtype)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, 64 if args.smoke else 2048, args.repeats)
    prompt = list(range(1, 33))

    hf_prompt = torch.tensor([prompt], device=device)
    hf_seconds = float("nan") if args.skip_hf else _timed(
        lambda: model.generate(hf_prompt, attention_mask=torch.ones_like(hf_prompt), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0), device, args.repeats)
    decoder = Decoder(model, None, backend="static", compile=compile_, max_length=len(prompt) + new_tokens + 80)
    fast_seconds = _timed(lambda: decoder.generate(prompt, new_tokens, method="plain"), device, args.repeats)
    prefill = decoder.generate(prompt, new_tokens, method="plain").stats.prefill_seconds

    tables: dict[str, str] | None = None
    if args.profile:
        tables = {"plain": _profile_table(lambda: decoder.generate(prompt, new_tokens, method="plain"))}
    speculative = speculative_step_cost(model, device, dtype, prompt, new_tokens, compile_, args.repeats, tables,
                                        tuple(m for m in args.methods.split(",") if m), args.trace_dir)
    if args.profile:
        Path(args.profile).write_text("".join(f"## {method}\n{table}\n" for method, table in tables.items()))

    verify = {}
    target = StaticTarget(model, 256, None, compile=False)
    for n in () if args.skip_verify_sweep else (1, 2, 4, 8, 16, 32, 48, 64):
        ids = torch.randint(0, model.config.vocab_size, (n,), device=device)
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()

        def step() -> None:
            target.reset()
            target.forward(ids[:1], torch.zeros(1, dtype=torch.long, device=device), mask[:1, :1])
            target.forward(ids, torch.arange(1, n + 1, device=device), mask)
        verify[n] = 1000 * _timed(step, device, args.repeats)
    one = verify.get(1, float("nan"))
    bound = bandwidth / model_bytes
    fast_tps = new_tokens / fast_seconds
    hf_tps = new_tokens / hf_seconds
    result = {
        "device": str(device), "dtype": str(dtype), "shape": shape, "smoke": args.smoke,
        "model_bytes": model_bytes, "copy_bandwidth_bytes_per_s": bandwidth, "bound_tokens_per_s": bound,
        "new_tokens": new_tokens, "compile": compile_,
        "hf_generate_tokens_per_s": hf_tps, "eaglekit_plain_tokens_per_s": fast_tps,
        "eaglekit_prefill_seconds": prefill,
        "speedup_vs_hf": fast_tps / hf_tps, "fraction_of_bound": fast_tps / bound,
        "goals": {"speedup_vs_hf>=3": fast_tps / hf_tps >= 3, "fraction_of_bound>=0.6": fast_tps / bound >= 0.6},
        "speculative_step_ms_random_drafter": speculative,
        "plain_step_ms": 1000 * fast_seconds / new_tokens,
        "verify_ms_by_tokens_eager_static": verify,
        "verify_cost_relative_to_1_token": {n: ms / one for n, ms in verify.items()},
        "compile_counters": compile_counters(),
        "environment": environment(),
    }
    atomic_write_json(args.output, result)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
