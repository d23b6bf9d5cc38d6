"""Decode-path probes behind three fast-path choices: top-k variants, what SDPA costs
the first time it meets a shape, and what a fused step costs per prompt.

    python benchmarks/decode_probe.py --out X.json        # a CUDA GPU; ~5 min

- `topk_us`: eager wall time per call of torch.topk, the two-pass top-k (`tree.top_k_rows`), argmax and
  sort. Host-bound at these sizes (every variant costs tens of microseconds of launch): kernel times
  come from `step_profile.py`;
- `sdpa_first_call`: per SDPA backend, the first call's ms and the steady us for new (T, S) shapes;
  PyTorch's default choice (cuDNN on an H200) builds an execution plan for every new shape;
- `prefill_ms`: the static target's eager prefill at new prompt lengths with PyTorch's SDPA choice and
  without cuDNN (since `static.attention`, eager calls avoid cuDNN themselves, so a re-run measures
  that path in both rows);
- `fixed_cost`: per method, [ms per step, steps, prefill ms] at 32 and 128 new tokens, and at prompt
  lengths never seen before, with the two-pass top-k on (`TOPK_CHUNK` 128) and off.
Measured on an H200 (an earlier form of this script, before `static.attention`; its two-pass rows are named
`_chunk128` / `_chunk256`): `results/latest/decode_probe.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import SHAPE_REFERENCE, build_model, random_drafter  # noqa: E402
from eaglekit.decode import Decoder  # noqa: E402
from eaglekit.decode import tree as tree_module  # noqa: E402
from eaglekit.decode.static import StaticTarget  # noqa: E402
from eaglekit.manifest import atomic_write_json, environment  # noqa: E402

NO_CUDNN = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
SHAPES = {"tree": dict(depth=6, tree_top_k=8, total_tokens=48), "chain": dict(chain_length=4), "plain": {}}


def wall_us(fn, calls: int = 200) -> float:
    """Eager wall time per call, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def topk_variants(device: torch.device) -> dict[str, float]:
    results = {}
    for rows in (1, 8):
        for width in (4096, 32000):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, width, device=device, dtype=dtype)
                key = f"{rows}x{width}_{str(dtype).removeprefix('torch.')}"
                assert torch.equal(tree_module.top_k_rows(x, 8)[0], torch.topk(x, 8, dim=-1).values), key
                results[f"{key}_topk"] = wall_us(lambda: torch.topk(x, 8, dim=-1))
                results[f"{key}_two_pass"] = wall_us(lambda: tree_module.top_k_rows(x, 8))
                results[f"{key}_argmax"] = wall_us(lambda: x.argmax(-1))
                results[f"{key}_sort"] = wall_us(lambda: torch.sort(x, dim=-1, descending=True))
    return results


def sdpa_first_call(device: torch.device) -> dict[str, dict | str]:
    """Prefill-shaped SDPA (T new tokens over a cache of T + 200, GQA 8/4 heads, bool mask) per backend."""
    results: dict[str, dict | str] = {}
    for name, backends in (("default", None), ("efficient+math", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                           ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("math", [SDPBackend.MATH])):
        for t in (70, 71, 517):
            s = t + 200
            q = torch.randn(1, 8, t, 64, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(1, 4, s, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
            mask = (torch.arange(s, device=device)[None] <= torch.arange(t, device=device)[:, None] + 3)[None, None]

            def call():
                if backends is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                results[f"{name}_T{t}"] = {"first_ms": (time.perf_counter() - start) * 1e3, "steady_us": wall_us(call, 50)}
            except RuntimeError as error:  # a backend that cannot take this shape
                results[f"{name}_T{t}"] = repr(error)[:200]
    return results


def prefill_at_new_lengths(model, device: torch.device) -> dict[str, list[float]]:
    target = StaticTarget(model, 1024, (2, 12, 21), compile=False)
    results: dict[str, list[float]] = {}
    with torch.inference_mode():
        for name, backends, lengths in (("default", None, (160, 161, 161, 400)), ("noncudnn", NO_CUDNN, (60, 61, 61, 300))):
            for n in lengths:
                target.reset()
                args = (torch.arange(1, n + 1, device=device), torch.arange(n, device=device),
                        torch.ones(n, n, dtype=torch.bool, device=device).tril())
                torch.cuda.synchronize()
                start = time.perf_counter()
                if backends is None:
                    target.forward(*args)
                else:
                    with sdpa_kernel(backends):
                        target.forward(*args)
                torch.cuda.synchronize()
                results.setdefault(f"{name}_T{n}", []).append((time.perf_counter() - start) * 1e3)
    return results


def _per_step(result, method: str) -> list[float]:
    steps = result.stats.target_forwards - 1 if method == "plain" else len(result.stats.accepted)
    return [result.stats.decode_seconds * 1e3 / steps, steps, result.stats.prefill_seconds * 1e3]


def fixed_cost(model, device: torch.device, prompt_length: int = 74) -> dict[str, list[float]]:
    drafter = random_drafter(model, device, torch.bfloat16)
    results: dict[str, list[float]] = {}
    for chunk in (128, 10**9):  # two-pass top-k on, then off
        tree_module.TOPK_CHUNK = chunk
        torch._dynamo.reset()
        decoder = Decoder(model, drafter, backend="static", compile=True, max_length=512)
        for method in ("tree", "chain", "plain") if chunk == 128 else ("tree", "chain"):
            prompt = list(range(1, prompt_length + 1))
            decoder.generate(prompt, 128, method=method, **SHAPES[method])
            for new_tokens in (32, 128):
                runs = sorted(_per_step(decoder.generate(prompt, new_tokens, method=method, **SHAPES[method]), method)
                              for _ in range(3))
                results[f"{method}_chunk{chunk}_n{new_tokens}"] = runs[1]
            for extra in (11, 12):  # prompt lengths this process has not seen yet
                fresh = list(range(3, prompt_length + extra))
                results[f"{method}_chunk{chunk}_newlen{extra}"] = _per_step(
                    decoder.generate(fresh, 32, method=method, **SHAPES[method]), method)
    tree_module.TOPK_CHUNK = 128
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_probe.py measures CUDA behaviour; run it on a GPU")
    device = torch.device("cuda")
    model = build_model(SHAPE_REFERENCE, device, torch.bfloat16)
    result = {"topk_us": topk_variants(device), "sdpa_first_call": sdpa_first_call(device),
              "prefill_ms": prefill_at_new_lengths(model, device), "fixed_cost": fixed_cost(model, device),
              "environment": environment()}
    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
