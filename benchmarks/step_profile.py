"""Where a decode step's time goes on the GPU: kernels per step, GPU time per step, host time per launch.

    python benchmarks/step_profile.py --out X.json                                   # reference shape, random weights
    python benchmarks/step_profile.py --target DIR --drafter DIR --prompt-file P.jsonl --out X.json  # a trained pair
    python benchmarks/step_profile.py --smoke --out /tmp/step_profile.json           # CPU, tiny shapes

For plain decoding and the fused speculative steps (`decode/fused.py`) it measures, on the same prompt:
- `step_ms`: wall time per step of the real fast path (torch.compile + CUDA graphs), median of repeats;
- `host_launch_ms` / `host_wait_ms`: per step, the host's time to launch a fused step and its time blocked
  on the step read back (a wait near zero means the host, not the GPU, sets the pace);
- `kernels_per_step`, `gpu_ms_per_step` and the costliest kernels: the same steps compiled without CUDA
  graphs (the same inductor kernels, launched one by one) under torch.profiler. In the CUDA graph the
  launch overheads mostly vanish, so `step_ms - gpu_ms_per_step` is what the graph still pays per kernel.
Steps are target forwards after the prefill (plain: one per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import SHAPE_REFERENCE, SHAPE_SMOKE, build_model, random_drafter  # noqa: E402
from eaglekit.decode import Decoder  # noqa: E402
from eaglekit.decode import graphs as compile_settings  # noqa: E402
from eaglekit.decode.fused import FusedStep  # noqa: E402
from eaglekit.manifest import atomic_write_json, environment  # noqa: E402

SHAPES = {"tree": dict(depth=6, tree_top_k=8, total_tokens=48), "chain": dict(chain_length=4), "plain": {}}


class _HostClock:
    """Wraps `FusedStep._launch` and the step read-back to time the host's share of each step."""

    def __init__(self):
        self.launch = self.wait = 0.0
        self.steps = 0

    def __enter__(self):
        launch, clock = FusedStep._launch, self

        def timed_launch(step, slot, generator):
            start = time.perf_counter()
            host, event = launch(step, slot, generator)
            clock.launch += time.perf_counter() - start
            clock.steps += 1
            return host, _TimedEvent(event, clock) if event is not None else None
        self._original, FusedStep._launch = launch, timed_launch
        return self

    def __exit__(self, *exc):
        FusedStep._launch = self._original


class _TimedEvent:
    def __init__(self, event, clock: _HostClock):
        self.event, self.clock = event, clock

    def synchronize(self) -> None:
        start = time.perf_counter()
        self.event.synchronize()
        self.clock.wait += time.perf_counter() - start


def _steps(result, method: str) -> int:
    return result.stats.target_forwards - 1 if method == "plain" else len(result.stats.accepted)


def _kernel_profile(run, method: str, top: int) -> dict:
    """Kernels launched and GPU time per step of one decode (no CUDA graphs), and the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = run()
    steps = max(_steps(result, method), 1)
    per_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name].append(event.device_time)
    kernels = sum(len(v) for v in per_name.values())
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels_per_step": kernels / steps, "gpu_ms_per_step": sum(map(sum, per_name.values())) / steps / 1000,
            "top_kernels": [{"name": name[:120], "per_step": len(t) / steps, "us_per_step": sum(t) / steps}
                            for name, t in rows]}


def measure(model, drafter, prompt: list[int], new_tokens: int, methods: list[str], repeats: int, top: int,
            cuda: bool) -> dict:
    capacity = len(prompt) + new_tokens + 64
    results = {}
    original = compile_settings.COMPILE_OPTIONS
    for graphs in (True, False) if cuda else (False,):
        options = dict(original)
        if not graphs:
            options.pop("mode", None)  # inductor kernels launched one by one (profilable)
        compile_settings.COMPILE_OPTIONS = options
        decoder = Decoder(model, drafter, backend="static", compile=cuda, max_length=capacity)
        for method in methods:
            def run():
                return decoder.generate(prompt, new_tokens, method=method, **SHAPES[method])
            run()  # compile / warm up
            row = results.setdefault(method, {})
            if graphs or not cuda:
                timings = []
                for _ in range(repeats):
                    with _HostClock() as clock:
                        result = run()
                    steps = max(_steps(result, method), 1)
                    timings.append((1000 * result.stats.decode_seconds / steps, 1000 * clock.launch / steps,
                                    1000 * clock.wait / steps, result.stats.tau))
                row.update(step_ms=statistics.median(t[0] for t in timings), tau=timings[0][3],
                           host_launch_ms=statistics.median(t[1] for t in timings),
                           host_wait_ms=statistics.median(t[2] for t in timings))
            if not graphs or not cuda:
                row.update(_kernel_profile(run, method, top))
    compile_settings.COMPILE_OPTIONS = original
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (proves the script runs)")
    parser.add_argument("--target", default="", help="a trained target directory (default: reference shape, random weights)")
    parser.add_argument("--drafter", default="", help="its drafter directory (with --target)")
    parser.add_argument("--prompt-file", default="", help="with --target: a conversations file; its first prompt is decoded")
    parser.add_argument("--methods", default="plain,tree,chain")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="costliest kernels listed per method")
    parser.add_argument("--inductor", default="", help="inductor settings to try, e.g. combo_kernels=1 (comma list)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.inductor.split(",") if item)
    for name, value in settings.items():
        setattr(torch._inductor.config, name, type(getattr(torch._inductor.config, name))(int(value) if value.isdigit() else value))
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    prompt = list(range(1, 33))
    if args.target:
        from eaglekit.data import prompt_messages, read_conversations
        from eaglekit.decode.setup import load_drafter, prompt_ids
        from eaglekit.targets.loading import load_target, load_tokenizer

        model = load_target(args.target, device, dtype)
        drafter = load_drafter(args.drafter, model, device, dtype)
        if args.prompt_file:
            prompt = prompt_ids(load_tokenizer(args.target), prompt_messages(read_conversations(args.prompt_file)[0]))
    else:
        model = build_model(SHAPE_SMOKE if args.smoke else SHAPE_REFERENCE, device, dtype)
        drafter = random_drafter(model, device, dtype)
    new_tokens = 8 if args.smoke else args.new_tokens
    methods = [m for m in args.methods.split(",") if m]
    result = {"device": str(device), "dtype": str(dtype), "target": args.target or ("smoke" if args.smoke else "reference shape, random weights"),
              "drafter": args.drafter or "random", "prompt_tokens": len(prompt), "new_tokens": new_tokens,
              "shapes": {m: SHAPES[m] for m in methods}, "inductor": settings,
              "methods": measure(model, drafter, prompt, new_tokens, methods, args.repeats, args.top, cuda),
              "environment": environment()}
    atomic_write_json(args.out, result)
    print(json.dumps({m: {k: v for k, v in r.items() if k != "top_kernels"} for m, r in result["methods"].items()}, indent=1))
    return result


if __name__ == "__main__":
    main()
