"""What one attention call of a fixed-shape decode step costs, per implementation, at the shapes the steps run:
T query tokens (1 plain, 5 a chain of 4, 49 a tree of 48) over a static cache of S slots under a boolean mask
(True = attend). On a GPU the calls are replayed from one CUDA graph of `--calls` calls, so the figures are
kernel time, not launch cost.

    python benchmarks/attention_cost.py --out X.json
    python benchmarks/attention_cost.py --smoke --out /tmp/attention_cost.json   # CPU, no graphs: proves it runs

Implementations:
- `sdpa`: `F.scaled_dot_product_attention` with `enable_gqa`, PyTorch's kernel choice (cuDNN on an H200): what
  the compiled steps of `decode/static.py` run;
- `efficient`: the memory-efficient kernel, K/V heads repeated to the query heads;
- `math_compiled`: scores, masked softmax and weighted sum as plain tensor ops under torch.compile, the query
  heads of each K/V head folded into one matrix ((nkv, g*T, D) x (nkv, D, S)).
`max_abs_diff` is each output's distance from `sdpa`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglekit.manifest import atomic_write_json, environment  # noqa: E402

HEADS = {"reference": (8, 4, 64), "8b": (32, 8, 128), "smoke": (4, 2, 16)}  # (query heads, K/V heads, head dim)
CACHES = {"reference": (256, 1024), "8b": (256, 2048), "smoke": (64,)}
TOKENS = (1, 5, 49)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def efficient(q, k, v, mask):
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def folded_math(q, k, v, mask):
    """q (1, nh, T, D) over k, v (1, nkv, S, D): query head h reads K/V head h // g, g = nh / nkv."""
    _, nh, t, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    scores = q.reshape(1, nkv, g * t, d) @ k.transpose(-1, -2) * d**-0.5  # (1, nkv, g*T, S)
    scores = scores.float().masked_fill(~mask.repeat(1, 1, g, 1), float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v).reshape(1, nh, t, d)


def make_inputs(heads: tuple[int, int, int], t: int, s: int, device, dtype):
    nh, nkv, d = heads
    q = torch.randn(1, nh, t, d, device=device, dtype=dtype)
    k, v = (torch.randn(1, nkv, s, d, device=device, dtype=dtype) for _ in range(2))
    length = s // 2  # the cached prefix, then the T new tokens (causal among themselves), then unused slots
    columns = torch.arange(s, device=device)
    rows = torch.arange(t, device=device)[:, None]
    mask = (columns < length)[None, :] | ((columns >= length) & (columns - length <= rows))
    return q, k, v, mask[None, None]


def per_call_us(fn, args, device, calls: int, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        return (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = torch.compile(folded_math, dynamic=False) if device.type == "cuda" else folded_math
    implementations = {"sdpa": sdpa, "efficient": efficient, "math_compiled": compiled}
    shapes = ["smoke"] if args.smoke else ["reference", "8b"]
    rows = []
    for shape in shapes:
        for s in CACHES[shape]:
            for t in TOKENS:
                inputs = make_inputs(HEADS[shape], t, s, device, dtype)
                reference = sdpa(*inputs).float()
                row = {"shape": shape, "heads": HEADS[shape], "tokens": t, "cache": s, "us": {}, "max_abs_diff": {}}
                for name, fn in implementations.items():
                    row["us"][name] = per_call_us(fn, inputs, device, args.calls, args.repeats)
                    row["max_abs_diff"][name] = (fn(*inputs).float() - reference).abs().max().item()
                row["fastest"] = min(row["us"], key=row["us"].get)
                rows.append(row)
                print(row, flush=True)
    result = {"benchmark": "attention_cost", "device": str(device), "dtype": str(dtype), "calls_per_graph": args.calls,
              "rows": rows, "environment": environment()}
    atomic_write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
